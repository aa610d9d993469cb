import os
import sys
from pathlib import Path

# No hub: any accidental download fails at once instead of retrying.
os.environ["HF_HUB_OFFLINE"] = "1"

# tests/tiny.py is a helper module shared by the test files.
sys.path.insert(0, str(Path(__file__).parent))
