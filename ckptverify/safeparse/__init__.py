"""Reading hostile bytes safely: files, JSON, pickles (by allowlist, never executed), zip archives."""
