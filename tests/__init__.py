"""sfnode's tests (run with trial, through tox).

The environment tox gives every test, for a run outside tox too: no model download (the tests
build their models, or use the bundled one), and OpenMP threads that sleep when idle rather than
spin (a test process runs torch beside its reactor).  Set here, before any test module imports
torch, whose OpenMP reads it once.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
