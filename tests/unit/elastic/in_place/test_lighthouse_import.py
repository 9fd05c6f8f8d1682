"""The cluster's lighthouse host starts torchft's lighthouse without importing torch
(torchft's package imports it: 1.4 CPU-seconds and about 560 MB of the head node's memory)."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import sys
from elastic.in_place.lighthouse import lighthouse_server_class

server = lighthouse_server_class()(
    bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=300
)
print(server.address().rsplit(":", 1)[1], "torch" in sys.modules)
server.shutdown()
import torchft.coordination  # torchft imported later reuses the extension already loaded

print(torchft.coordination.LighthouseServer is lighthouse_server_class())
"""


def test_the_lighthouse_starts_without_torch_and_torchft_still_imports_after_it() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    port, torch_imported, same_class = out
    assert int(port) > 0
    assert torch_imported == "False"
    assert same_class == "True"
