"""The files ckptverify writes: their names, how they are written, the manifest, the event log."""
