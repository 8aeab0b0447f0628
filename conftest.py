"""Root pytest configuration: applies to tests/ and to the notebooks nbval runs.

Set before any kernel or model starts: no network for the hub, a non-interactive matplotlib backend.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import minfer.envs as envs

# The suite's engines run in this process: their OpenMP wait policy goes in before torch loads (minfer.envs).
envs.configure_process("offline")
