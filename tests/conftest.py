import sys
from pathlib import Path

# tests/tiny.py is a helper module shared by the test files.
sys.path.insert(0, str(Path(__file__).parent))
