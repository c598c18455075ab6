"""A timm folder published (convert/publish.py, `vitlab.export format=timm`): its model card and its upload to the Hub.

The upload is tested against a stand-in for the Hub's HTTP API on 127.0.0.1 (HubStandIn below: the endpoints
huggingface_hub's create_repo, create_branch and upload_folder call, answered as the Hub answers them), since offline
huggingface_hub cannot be pointed at anything real: what reaches the stand-in is what would reach the Hub.
"""

import base64
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import lightning as L
import pytest
import requests
import timm
import torch
import yaml
from huggingface_hub import HfApi, ModelCard, constants
from omegaconf import OmegaConf

from tests.helpers.configs import tiny
from vitlab import export
from vitlab.training.module import ViTModule
from vitlab.utils.errors import OfflineError, UserError


class HubStandIn(ThreadingHTTPServer):
    """The Hub's API as upload_folder meets it: repos, branches, preupload (every file a regular git blob, so its
    bytes come in the commit), the model card's metadata check, and the commit itself, which lands whole or (with
    `refuse_commits`) not at all."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"
        self.requests, self.repos, self.commits, self.validated, self.refuse_commits = [], {}, [], [], False


class _Handler(BaseHTTPRequestHandler):
    server: HubStandIn

    def log_message(self, *args):  # (quiet)
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        hub, parts = self.server, self.path.split("?")[0].strip("/").split("/")
        hub.requests.append(("POST", self.path, self.headers.get("authorization")))
        if parts[:2] == ["api", "validate-yaml"]:  # the model card's metadata, which the Hub checks before a commit
            metadata = yaml.safe_load(json.loads(body)["content"].split("---")[1])
            hub.validated.append(metadata)
            ok = isinstance(metadata, dict) and "library_name" in metadata
            return self._json(
                {"errors": [] if ok else [{"message": "no metadata"}], "warnings": []}, 200 if ok else 400
            )
        if parts[:3] == ["api", "repos", "create"]:
            request = json.loads(body)
            repo = f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
            private = request.get("visibility", "private" if request.get("private") else "public") == "private"
            hub.repos.setdefault(repo, {"private": private, "branches": {"main"}})
            return self._json({"url": f"{hub.endpoint}/{repo}", "name": repo})
        repo = "/".join(parts[2:4])
        if parts[:2] != ["api", "models"] or repo not in hub.repos:
            return self._json({"error": f"Repository {repo} not found"}, 404)
        if parts[4] == "branch":
            hub.repos[repo]["branches"].add(parts[5])
            return self._json({})
        if parts[4] == "preupload":
            files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                     for f in json.loads(body)["files"]]  # fmt: skip
            return self._json({"files": files, "commitOid": "0" * 40})
        if parts[4] == "commit":
            if hub.refuse_commits:
                return self._json({"error": "You don't have the rights to write to this repo"}, 403)
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            files = {v["path"]: base64.b64decode(v["content"]) for k, v in map(_entry, lines) if k == "file"}
            hub.commits.append({"repo": repo, "revision": parts[5], "files": files})
            return self._json({"commitUrl": f"{hub.endpoint}/{repo}/commit/{'1' * 40}", "commitOid": "1" * 40})
        return self._json({"error": f"not in the stand-in: {self.path}"}, 404)

    def _json(self, value, status=200):
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _entry(line: dict) -> tuple[str, dict]:
    return line["key"], line["value"]


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The stand-in, where huggingface_hub sends its requests (HF_ENDPOINT, read at import, set as it would be), online
    for this test, with a token in the environment and none in a file."""
    server = HubStandIn()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in_token")
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def run_ckpt(tmp_path, compose_cfg):
    """A tiny digits checkpoint in a run directory's checkpoints/, with the metrics.json and config.yaml a run writes
    beside it (test metrics as vitlab.train writes them)."""
    train = compose_cfg("train", [])
    torch.manual_seed(0)
    module = ViTModule(model=tiny(img_size=8, patch_size=2, in_chans=1, num_classes=10),
                       data=OmegaConf.to_container(train.data, resolve=True),
                       class_names=[str(i) for i in range(10)])  # fmt: skip
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    hp = json.loads(json.dumps(dict(module.hparams)))
    ckpt = run / "checkpoints" / "epoch_000.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": hp, "pytorch-lightning_version": L.__version__},
               ckpt)  # fmt: skip
    metrics = {"val/acc_best": 0.5, "test/loss": 1.2345678901234567, "test/acc": 0.6296296296296297,
               "test/acc_top5": 0.9, "splits": {"test": "270 digits"}, "run_dir": str(run)}  # fmt: skip
    (run / "metrics.json").write_text(json.dumps(metrics, indent=2))
    config = {k: OmegaConf.to_container(train[k], resolve=True) for k in ("model", "objective", "data", "optim")}
    config |= {"seed": 42, "trainer": {"max_epochs": 3, "precision": "32-true"}}  # (config.yaml: resolved, as here)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return ckpt


def _export(compose_cfg, ckpt, out, *more):
    return export.export(compose_cfg("export", [f"ckpt_path={ckpt}", "format=timm", f"output={out}", *more]))


def test_the_card_is_the_hubs_format_with_the_runs_test_metrics(compose_cfg, run_ckpt, tmp_path):
    """README.md beside config.json: YAML metadata the Hub reads (library timm, tags, license, datasets, model-index
    with each test metric), the metrics exactly as metrics.json holds them, the training config, timm's read-back."""
    out = tmp_path / "timm"
    report = _export(compose_cfg, run_ckpt, out, "license=apache-2.0", "datasets=[ylecun/mnist]")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    card = ModelCard.load(out / "README.md")
    metrics = json.loads((run_ckpt.parents[1] / "metrics.json").read_text())
    tested = {k: v for k, v in metrics.items() if k.startswith("test/")}
    assert (card.data.library_name, card.data.license, card.data.datasets) == ("timm", "apache-2.0", ["ylecun/mnist"])
    assert {"timm", "image-classification"} <= set(card.data.tags)
    assert {r.metric_name: r.metric_value for r in card.data.eval_results} == tested
    assert {r.metric_type for r in card.data.eval_results} == {"loss", "accuracy", "top_5_accuracy"}
    rows = {line.split("|")[1].strip(" `"): line.split("|")[2].strip() for line in card.text.splitlines()
            if line.startswith("| `test/")}  # fmt: skip
    assert {k: float(v) for k, v in rows.items()} == tested  # the table: the same numbers, every digit
    architecture = json.loads((out / "config.json").read_text())["architecture"]
    assert f"builds timm's own `{architecture}`" in card.text and f"{report['max_abs_diff']:.3g} at most" in card.text
    assert f'timm.create_model("local-dir:{out}", pretrained=True)' in card.text
    assert f'vitlab.create_model("local-dir:{out}", pretrained=True)' in card.text
    assert "| objective | classify |" in card.text and "| optimizer | adamw, lr 0.001" in card.text
    theirs = timm.create_model(f"local-dir:{out}", pretrained=True)
    assert f"| parameters | {sum(p.numel() for p in theirs.parameters()):,} |" in card.text


def test_a_checkpoint_outside_a_run_gets_a_card_that_says_so(compose_cfg, run_ckpt, tmp_path):
    alone = tmp_path / "alone.ckpt"
    alone.write_bytes(run_ckpt.read_bytes())
    _export(compose_cfg, alone, tmp_path / "timm")
    card = ModelCard.load(tmp_path / "timm" / "README.md")
    assert card.data.license is None and not card.data.eval_results
    assert "No test metrics: no run directory (metrics.json) beside the checkpoint." in card.text


def test_push_to_hub_uploads_the_folder_in_one_commit(compose_cfg, run_ckpt, tmp_path, hub):
    """create_repo (private), the branch made, one commit holding every file of the folder byte for byte, the token
    from the environment; the card names the repo as timm loads it."""
    out = tmp_path / "timm"
    report = _export(compose_cfg, run_ckpt, out, "push_to_hub=me/digits-vit", "private=true", "revision=v1")
    (commit,) = hub.commits
    assert (commit["repo"], commit["revision"]) == ("me/digits-vit", "v1")
    assert commit["files"] == {p.name: p.read_bytes() for p in out.iterdir()}
    assert hub.repos["me/digits-vit"] == {"private": True, "branches": {"main", "v1"}}
    assert [m["library_name"] for m in hub.validated] == ["timm"]
    assert {auth for *_, auth in hub.requests} == {"Bearer hf_stand_in_token"}
    assert report["commit_url"].startswith(f"{hub.endpoint}/me/digits-vit/commit/")
    assert 'timm.create_model("hf-hub:me/digits-vit", pretrained=True)' in (out / "README.md").read_text()


def test_a_refused_commit_is_one_line_and_the_hub_holds_nothing(compose_cfg, run_ckpt, tmp_path, hub):
    hub.refuse_commits = True
    with pytest.raises(UserError, match=r"push_to_hub=me/x failed \(.*403.*\); nothing was committed to the Hub"):
        _export(compose_cfg, run_ckpt, tmp_path / "timm", "push_to_hub=me/x")
    assert hub.commits == [] and (tmp_path / "timm" / "README.md").is_file()  # the folder is kept, said in the line


@pytest.mark.parametrize("cause", ["httpx", "requests", "nothing listening"])
def test_a_hub_out_of_reach_is_one_line_and_the_folder_kept(compose_cfg, run_ckpt, tmp_path, hub, monkeypatch, cause):
    """issue 74, point 7: with a token and no network the push was httpx's 87-line traceback (only HfHubHTTPError,
    OfflineModeIsEnabled and OSError were caught). The upload raising httpx's or requests' connection error, or
    huggingface_hub sent where nothing listens (whichever HTTP stack it runs on): one line that keeps the exported
    folder and says where it is and how to upload it later."""
    if cause == "nothing listening":
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    else:
        error = {
            "httpx": httpx.ConnectError("[Errno -3] Temporary failure in name resolution"),
            "requests": requests.exceptions.ConnectionError("Max retries exceeded with url: /api/repos/create"),
        }

        def unreachable(*args, **kwargs):
            raise error[cause]

        monkeypatch.setattr(HfApi, "upload_folder", unreachable)
    out = tmp_path / "timm"
    with pytest.raises(OfflineError) as caught:
        _export(compose_cfg, run_ckpt, out, "push_to_hub=me/x", "revision=v1")
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"push_to_hub=me/x failed: the Hub ({constants.ENDPOINT}) cannot be")
    assert line.endswith(f"the folder is in {out}: upload it once online with `hf upload me/x {out} --revision v1`")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert hub.commits == []


@pytest.mark.parametrize("case", ["offline", "no token", "not a repo id"])
def test_push_refused_before_anything_is_exported(compose_cfg, run_ckpt, tmp_path, hub, monkeypatch, case):
    repo, error, match = "me/x", UserError, "needs a Hugging Face token: set HF_TOKEN or run `hf auth login`"
    if case == "offline":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        error, match = OfflineError, r"huggingface_hub is offline \(HF_HUB_OFFLINE=1\); nothing was exported"
    if case == "no token":
        monkeypatch.delenv("HF_TOKEN")
    if case == "not a repo id":
        repo, match = "digits-vit", "push_to_hub 'digits-vit' is not a Hub repo id: give <user or organization>/<name>"
    with pytest.raises(error, match=match):
        _export(compose_cfg, run_ckpt, tmp_path / "timm", f"push_to_hub={repo}")
    assert not (tmp_path / "timm").exists() and hub.requests == []


def test_the_config_yaml_a_run_writes_is_what_the_card_reads(tmp_path):
    """Run.of_checkpoint reads config.yaml as plain YAML (convert/ imports no OmegaConf): a run's file is plain."""
    from vitlab.convert.publish import Run

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "metrics.json").write_text('{"test/acc": 0.5, "run_dir": "x"}')
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"seed": 3, "objective": {"name": "mae"}}))
    run = Run.of_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert (run.run_dir, run.test_metrics(), run.config["seed"]) == (tmp_path, {"test/acc": 0.5}, 3)
    assert Run.of_checkpoint(tmp_path / "last.ckpt").run_dir == tmp_path  # a checkpoint in the run directory itself
    assert Run.of_checkpoint(tmp_path / "checkpoints" / "sub" / "x.ckpt").run_dir is None


def test_the_card_of_a_peft_run_says_which_adapter_was_merged_and_over_which_base():
    """format=timm of an adapter checkpoint (issue 75, point 4): the training table names the base (started from) and
    the adapter merged into the weights, for each method; a full fine-tune has no such row."""
    from vitlab.convert.publish import Run, _training

    def card(**peft):
        config = {"model": {"pretrained": "/runs/base/last.ckpt"}, "peft": {"trainable": ["head"], **peft}}
        return _training(Run(None, {}, config))

    lora = card(method="lora", rank=8, alpha=16, targets=["qkv", "fc1"])
    assert "| started from | /runs/base/last.ckpt |" in lora
    assert (
        "| fine-tuned (peft) | LoRA rank 8, alpha 16 on qkv, fc1; trained whole: head; merged into these weights"
        in lora
    )
    assert "DoRA rank 4, alpha 8 (rsLoRA scaling) on qkv" in card(method="dora", rank=4, alpha=8, targets=["qkv"],
                                                                   use_rslora=True)  # fmt: skip
    assert "BitFit: the biases and norms" in card(method="bitfit")
    assert "the last 2 blocks and the final norm, blocks.*.attn.*" in card(method="partial", blocks=2,
                                                                           names=["blocks.*.attn.*"])  # fmt: skip
    assert "fine-tuned" not in card(method="none")
