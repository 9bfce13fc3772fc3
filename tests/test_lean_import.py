import subprocess
import sys


def test_import_is_lean():
    code = (
        "import sys, optimum_flatten;"
        "heavy = [m for m in ('datasets', 'peft', 'matplotlib', 'lm_eval') if m in sys.modules];"
        "import torch;"
        "print(heavy, torch.cuda.is_initialized())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[] False"
