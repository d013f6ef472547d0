"""Workload generators and benchmark code behind the upstream-style CLIs."""
