"""The supervisor: one detached Ray actor per job that routes it between scheduling, running
an attempt and recovering. Its policies are pure functions of the facts, tested without Ray."""
