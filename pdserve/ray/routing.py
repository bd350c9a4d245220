"""The replica router is pdserve/routing.py (the P/D proxy uses it too); pdserve/sim still imports
it by this name."""
from pdserve.routing import POLICIES, Router, prompt_block_hashes  # noqa: F401
