"""The service's HTTP routes, one module per area."""
