"""Production mode of the Run protocol: a real job that saves, traces and checks its replicas."""
