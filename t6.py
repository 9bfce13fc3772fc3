from base import *
import datasets, logging
logging.disable(logging.WARNING)
from optimum_flatten import FlattenConfig, FlattenQuantizer
D = "/tmp/review_api/data/"
tok = tiny_models.tiny_hf_tokenizer()
texts = tiny_models.sample_texts(60)
def comp(label, ds):
    model = tiny_models.tiny_llama_gqa()
    try:
        FlattenQuantizer(FlattenConfig(method="shortgpt", num_layers_to_remove=2, dataset=ds, nsamples=8, seqlen=24), progress=False).compress(model, tok)
        print(f"[compress {label}] OK")
    except Exception as e:
        print(f"[compress {label}] {type(e).__name__}: {str(e)[:200]}")
stream = datasets.load_dataset("json", data_files=D+"a.jsonl", split="train", streaming=True)
print("streaming column_names:", stream.column_names)
comp("list of {'text'} dicts", [{"text": t} for t in texts])
comp("streaming json", stream)
comp("DatasetDict", datasets.load_dataset("json", data_files=D+"a.jsonl"))
try_recover("recover streaming json", stream)
try_recover("recover load_dataset no split (DatasetDict)", datasets.load_dataset("json", data_files=D+"a.jsonl"))
