"""`looplm convert --init aware --lora-init aware-svd --calib-text ...` end to end on a small checkpoint."""

import json
import random

import pytest
from conftest import run_cli as run
from conftest import save_tiny_llama

pytestmark = pytest.mark.real  # every test reads SmolLM2's tokenizer (hf_dir)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, smollm2_tokenizer):
    """The tiny Llama with its norm weights perturbed, so that tying them matters."""
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", smollm2_tokenizer, norm_noise=0.3)


@pytest.fixture(scope="module")
def calib_text(tmp_path_factory):
    """A generated training-style text (never the held-out sample)."""
    rng = random.Random(0)
    words = "the king and queen of a far land rode out at dawn to see their fields and men".split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(200))
    path = tmp_path_factory.mktemp("calib") / "train.txt"
    path.write_text(text)
    return path


# convert's options for two loops at full LoRA rank (which can keep the model exactly), scored on 256 tokens, as JSON
FULL_RANK = ["--loops", "2", "--lora-rank", "full", "--scored-tokens", "256", "--json"]


def calibrated_on(calib_text) -> list[str]:
    """Convert's options that calibrate on 512 tokens of ``calib_text``, in rows of 128."""
    return ["--calib-text", str(calib_text), "--calib-tokens", "512", "--calib-seq-len", "128"]


def test_full_rank_data_aware_conversion_keeps_the_perplexity(hf_dir, calib_text, tmp_path):
    """Tied norms and all: a full-rank aware-svd model is the original model (plain svd is not)."""
    common = [str(hf_dir), *FULL_RANK, "--norms", "tied-avg"]
    aware_svd = ["--init", "aware", "--lora-init", "aware-svd", *calibrated_on(calib_text)]
    aware = json.loads(run("convert", *common, "--out", str(tmp_path / "a"), *aware_svd).stdout)
    assert aware["calibration"]["tokens"] == 512 and aware["calibration"]["fold_norms"] is True
    assert aware["ppl_after"] == pytest.approx(aware["ppl_before"], rel=1e-4)
    plain = json.loads(run("convert", *common, "--out", str(tmp_path / "p"), "--lora-init", "svd").stdout)
    assert abs(plain["ppl_after"] / plain["ppl_before"] - 1) > 1e-3
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved["conversion"]["init"] == "aware" and saved["conversion"]["lora_init"] == "aware-svd"


def test_the_default_conversion_calibrates_on_the_shipped_text(hf_dir, tmp_path):
    """With no calibration text given, the data-aware default (aware-svd LoRA, per-depth norms) calibrates on
    the training-split text the package ships; plain SVD calibrates on nothing."""
    from looplm.data import CALIBRATION_TEXT

    common = ["convert", str(hf_dir), "--lora-rank", "4", "--scored-tokens", "0", "--calib-tokens", "256", "--json"]
    default = json.loads(run(*common, "--out", str(tmp_path / "d")).stdout)
    assert default["calibration"]["source"] == str(CALIBRATION_TEXT) and default["calibration"]["tokens"] == 256
    saved = json.loads((tmp_path / "d" / "config.json").read_text())["conversion"]
    assert saved["lora_init"] == "aware-svd" and saved["norms"] == "per-depth"
    plain = json.loads(run(*common, "--out", str(tmp_path / "p"), "--lora-init", "svd").stdout)
    assert "calibration" not in plain
    assert json.loads((tmp_path / "p" / "config.json").read_text())["conversion"]["norms"] == "tied-avg"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--init", "aware", "--calib-text", "HELDOUT"], "held-out"),
        (["--init", "aware", "--calib-data", "NOWHERE"], "does not exist"),
    ],
)
def test_data_aware_conversion_refuses_missing_or_heldout_calibration(hf_dir, tmp_path, args, message):
    from looplm.data import sample_text

    held = tmp_path / "held.txt"
    held.write_text(sample_text())
    args = [str(held) if a == "HELDOUT" else str(tmp_path / "nowhere") if a == "NOWHERE" else a for a in args]
    out = tmp_path / "never"
    proc = run("convert", str(hf_dir), "--out", str(out), "--scored-tokens", "0", *args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_gemma3_full_rank_aware_svd_is_exact_with_per_depth_norms_and_warns_with_tied(
    smollm2_tokenizer, calib_text, tmp_path
):
    """Gemma 3's post-norms and q/k norms cannot be folded: per-depth norms keep the full-rank aware-svd
    model exact; tied norms get a warning that names the fix (--norms per-depth)."""
    from conftest import make_hf_model

    hf = make_hf_model("gemma3")
    hf.resize_token_embeddings(len(smollm2_tokenizer))
    d = tmp_path / "tiny-gemma3"
    hf.save_pretrained(d)
    smollm2_tokenizer.save_pretrained(d)
    common = ["convert", str(d), *FULL_RANK, "--lora-init", "aware-svd", *calibrated_on(calib_text)]
    exact = run(*common, "--norms", "per-depth", "--out", str(tmp_path / "pd"))
    result = json.loads(exact.stdout)
    assert result["ppl_after"] == pytest.approx(result["ppl_before"], rel=1e-4)
    assert "warning" not in exact.stderr
    tied = run(*common, "--norms", "tied-avg", "--out", str(tmp_path / "tied"))
    assert tied.returncode == 0 and "use --norms per-depth" in tied.stderr


def test_python_converts_as_the_command_line_does(hf_dir, calib_text, tmp_path):
    """``convert_model(ConvertConfig(...))`` is `looplm convert` with the same settings: the command line's defaults
    (middle-cycle, the equal-N-emb rank, aware-svd on per-depth norms) and the same weights."""
    import torch
    from safetensors.torch import load_file

    from looplm.models import save_model
    from looplm.recipes import ConvertConfig, convert_model

    calib = ["--calib-text", str(calib_text), "--calib-tokens", "512", "--calib-seq-len", "128", "--scored-tokens", "0"]
    run("convert", str(hf_dir), *calib, "--out", str(tmp_path / "cli"))
    config = ConvertConfig(str(hf_dir), calib_text=[str(calib_text)], calib_tokens=512, calib_seq_len=128, ppl_tokens=0)
    model, tok, report = convert_model(config)
    assert (config.strategy, config.norms, model.config.conversion["lora_init"]) == (
        "middle-cycle",
        "per-depth",
        "aware-svd",
    )
    assert model.config.is_relaxed and report["out"].endswith("-b2-r111")  # the rank of the paper's N-emb
    save_model(model, tok, tmp_path / "py")
    cli, py = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("cli", "py"))
    assert cli.keys() == py.keys() and all(torch.equal(cli[k], py[k]) for k in cli)
