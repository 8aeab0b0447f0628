"""Root pytest configuration: applies to tests/ and to the notebooks nbval runs.

Set before any kernel or model starts: no network for the hub, a non-interactive matplotlib backend.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see minfer/__init__.py
