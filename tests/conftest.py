import os
import sys

# tests/fd.py and other helpers are imported as plain modules by the tests.
sys.path.insert(0, os.path.dirname(__file__))
