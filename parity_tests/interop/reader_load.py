"""Run by a reader's own Python (a transformers 4.x or 5.x in its virtualenv): each export loaded as that
transformers loads it, and its logits (an encoder's last hidden state) written for the matrix to compare.

    READER_PYTHON parity_tests/interop/reader_load.py JOBS_JSON OUT_DIR

``JOBS_JSON`` lists the exports (``readers_matrix.write_exports``): name, folder, ``model_type``, kind
(``causal``, ``encoder`` or ``peft``: an adapter folder on its ``base`` folder) and the inputs file (ids and
mask). For each export, ``OUT_DIR/NAME.npy`` holds what the reader computed, and the one JSON line printed
holds the reader's version and, per export, ``ok`` with transformers' (or peft's) loading report (the
lists that are not empty), ``absent`` when this transformers has no such ``model_type``, or ``refused``
with the error's first line. Imports only transformers, torch, numpy (and peft for adapters): nothing of
this repository, whose transformers may be another version.
"""

import json
import sys
import warnings

import numpy as np
import torch
import transformers

OLD_DTYPE = tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (4, 56)  # `dtype=` came with 4.56


def _auto(kind: str):
    return transformers.AutoModel if kind == "encoder" else transformers.AutoModelForCausalLM


def _peft(model, folder: str) -> tuple[object, dict]:
    """The adapter on ``model`` as ``PeftModel.from_pretrained`` loads it, and what a second load of it left out."""
    import peft
    import torch.distributed.tensor  # noqa: F401  peft 0.21 uses it unimported (transformers 5 imports it, 4.x not)

    model = peft.PeftModel.from_pretrained(model, folder)
    report = model.load_adapter(folder, adapter_name="again")  # the same files: its keys report is the check
    model.set_adapter("default")
    info = {"missing_keys": [k for k in report.missing_keys if "lora_" in k],
            "unexpected_keys": list(report.unexpected_keys)}
    return model, info


def load(job: dict, ids: torch.Tensor, mask: torch.Tensor) -> tuple[dict, np.ndarray | None]:
    """(the export's row of the report, what the reader computed or None)."""
    if job["model_type"] not in transformers.CONFIG_MAPPING:
        return {"status": "absent"}, None
    kwargs = {"torch_dtype" if OLD_DTYPE else "dtype": torch.float32, "output_loading_info": True,
              "attn_implementation": "eager"}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, info = _auto(job["kind"]).from_pretrained(job.get("base") or job["folder"], **kwargs)
            info = {k: sorted(map(str, v)) for k, v in info.items() if v}
            if job["kind"] == "peft":
                model, adapter = _peft(model, job["folder"])
                info.update({f"adapter {k}": v for k, v in adapter.items() if v})
            with torch.no_grad():
                out = model.eval()(input_ids=ids, attention_mask=mask, **({} if job["kind"] == "encoder" else
                                                                         {"use_cache": False}))
    except Exception as error:  # the reader refused the folder: its first line is the cell
        return {"status": "refused", "reason": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}, None
    result = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return {"status": "ok", "info": info}, result.float().numpy()


def main(jobs_json: str, out_dir: str) -> None:
    transformers.logging.set_verbosity_error()
    jobs = json.loads(open(jobs_json, encoding="utf-8").read())
    rows = {}
    for job in jobs:
        data = np.load(job["inputs"])
        row, result = load(job, torch.from_numpy(data["ids"]), torch.from_numpy(data["mask"]))
        if result is not None:
            np.save(f"{out_dir}/{job['name']}.npy", result)
        rows[job["name"]] = row
    print(json.dumps({"version": transformers.__version__, "file": transformers.__file__, "rows": rows}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
