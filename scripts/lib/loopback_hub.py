"""A Hugging Face hub on 127.0.0.1 for the README scripts: serves each checkpoint directory
under the model id it is given, prints the hub's URL (for HF_ENDPOINT) and runs until SIGTERM.

    python scripts/lib/loopback_hub.py ORG/NAME=DIR [ORG/NAME=DIR ...]

(used by scripts/readme-clone.sh and scripts/readme-models.sh; the hub is testsupport/hub.py)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: testsupport
from testsupport.hub import LocalHub, read_dir  # noqa: E402

hub = LocalHub().start()
for pair in sys.argv[1:]:
    repo_id, directory = pair.split("=", 1)
    hub.add_repo(repo_id, read_dir(Path(directory)))
print(hub.url, flush=True)
signal.sigwait({signal.SIGTERM, signal.SIGINT})
hub.stop()
