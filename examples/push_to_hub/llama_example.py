"""Compress and publish: weights, tokenizer, flatten_report.json, heatmap and a generated model card.

python examples/push_to_hub/llama_example.py --repo you/model-flat      # needs `hf auth login` and network
python examples/push_to_hub/llama_example.py --tiny                     # dry run: shows what would be sent
"""

import argparse
import sys
import tempfile
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _setup import checkpoint

from optimum_flatten import FlattenConfig, FlattenQuantizer


class DryRunApi:
    """Prints what huggingface_hub's HfApi would be asked to do, and does nothing else."""

    def create_repo(self, repo_id, **kwargs):
        print(f"would create repo {repo_id} {kwargs}")

    def upload_folder(self, *, repo_id, folder_path, commit_message=None, **kwargs):
        print(f"would upload to {repo_id} ({commit_message!r}):", sorted(p.name for p in Path(folder_path).iterdir()))
        return f"https://huggingface.co/{repo_id} (dry run)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repo", default="me/tiny-llama-flattened")
    args = parser.parse_args()
    path, dataset, sizes = checkpoint(args.tiny)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    quantizer = FlattenQuantizer(FlattenConfig(dataset=dataset, **sizes))
    quantizer.compress(model, tokenizer)
    print("plan:", quantizer.report["plan_summary"])
    with tempfile.TemporaryDirectory() as tmp:
        url = quantizer.push_to_hub(
            model, args.repo, tokenizer, local_dir=Path(tmp) / "upload", api=DryRunApi() if args.tiny else None
        )
        print("model card starts with:", (Path(tmp) / "upload" / "README.md").read_text().splitlines()[:3])
    print("uploaded:", url)


if __name__ == "__main__":
    main()
