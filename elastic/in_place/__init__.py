"""In-place recovery (``fault_tolerance: in_place``): one Ray actor per replica, each with a
torchft ``Manager``; a quorum is formed every step, survivors of a node loss train on at the
smaller size from the same step, and joiners heal from a peer. See docs/architecture.md."""
