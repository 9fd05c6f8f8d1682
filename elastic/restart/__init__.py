"""Restart mode (``fault_tolerance: restart``): a pool of warm worker actors that outlive the job's
attempts, and the supervisor's runner that restarts an attempt on them from a checkpoint."""
