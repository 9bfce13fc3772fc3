"""laco on a LLaMA-family model, with the same calibration and export as every other method.

python examples/laco/llama_example.py [--tiny]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _setup import compress_and_report

if __name__ == "__main__":
    compress_and_report("laco", __doc__, threshold=None)
