"""The cluster's side: what Ray holds and has free, the membership watcher actor shared by
every job, and the scheduler's pure policy and books."""
