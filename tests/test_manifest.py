"""The manifest is not trusted blindly: every number is typed and range-checked, the architecture is
cross-checked against the hashed files it describes, every file the loader reads is listed, and each
failure is one ArtifactError line (issue #7 defects 5, 6 and 7)."""
import json
import shutil
import time

import pytest
import yaml

import runtime
import runtime.native
from runtime.artifact import ArtifactError, load_manifest, write_manifest


@pytest.fixture(params=["native", "onnxruntime"])
def art(request, tiny_artifacts, tmp_path):
    d = tmp_path / request.param
    shutil.copytree(tiny_artifacts[request.param], d)
    return d


def _rewrite(d, fn):
    """Edit the manifest and re-hash the files, as a careless (or hostile) user with an editor would."""
    raw = yaml.safe_load((d / "manifest.yaml").read_text())
    names = list(raw.pop("files"))
    raw.pop("format_version")
    fn(raw)
    (d / "manifest.yaml").write_text(yaml.safe_dump(dict(raw, format_version=runtime.artifact.FORMAT_VERSION,
                                                         files={n: {"size": 0, "sha256": "0" * 64} for n in names})))
    try:
        write_manifest(d, raw, names)
    except ArtifactError:
        pass  # write_manifest checks too; the hand-written (unhashed) manifest above is what gets loaded


def _arch(**kw):
    return lambda m: m["model"]["architecture"].update(kw)


@pytest.mark.parametrize("edit,msg", [
    (_arch(n_layers=1), "architecture does not match"),  # 2 -> 1: parses, sizes differ
    (_arch(rope_base=20000.0), "architecture does not match"),  # same sizes, garbage output
    (_arch(rope_base=0), r"rope_base = 0 is not a number in \[1"),
    (_arch(n_heads=8, head_dim=8), "architecture does not match"),  # keeps every byte size
    (_arch(n_kv_heads=0), r"n_kv_heads = 0 is out of range"),
    (_arch(n_layers=1000000000), r"n_layers = 1000000000 is out of range \[1, 256\]"),
    (_arch(vocab="many"), "vocab should be an integer, found str"),
    (_arch(norm_eps=float("nan")), "norm_eps"),
    (_arch(hidden=65), r"n_heads x head_dim"),
    (lambda m: m["model"]["architecture"].pop("ffn"), "missing field ffn"),
    (lambda m: m.update(max_context=0), r"max_context = 0 is out of range"),
    (lambda m: m.update(max_context=10**9), r"max_context = 1000000000 is out of range"),
    (lambda m: m["tokenizer"].update(eos_id=10**9), r"tokenizer.eos_id = 1000000000 is out of range"),
    (lambda m: m["tokenizer"].update(stop_ids=[2, 10**9]), "stop_ids should be token ids"),
    (lambda m: m["tokenizer"].update(bos_id=-1), "bos_id = -1 is out of range"),
    (lambda m: m.update(backend="tpu9000"), "backend 'tpu9000' is not in this runtime"),
    (lambda m: m["kv_cache"].update(layout="diagonal"), "kv_cache.layout 'diagonal' is not the"),
    (lambda m: m["kv_cache"].update(scheme="fp8"), "kv_cache.scheme 'fp8' is not supported"),
    (lambda m: m["quantization"].update(bits=True), "bits' should be int"),
])
def test_edited_manifest_is_refused_with_one_line(art, edit, msg):
    """Defect 7: one changed number that still parses loaded and generated garbage with exit 0, and zeros,
    huge ids and unknown names gave KeyError/TypeError/ZeroDivisionError/IndexError tracebacks."""
    _rewrite(art, edit)
    t0 = time.monotonic()
    with pytest.raises(ArtifactError, match=msg) as e:
        runtime.load(art)
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 5  # n_layers 1e9 grew memory for a minute


def test_unknown_architecture_keys_are_kept_aside(art):
    """Defect 6: the architecture was an unvalidated dict; now a typed config whose unknown keys are kept."""
    _rewrite(art, _arch(sliding_window=4096))
    with pytest.raises(ArtifactError, match="architecture does not match"):  # the hashed files say otherwise
        runtime.load(art)
    m = load_manifest(art, verify_files=False)
    assert m.architecture.extra == {"sliding_window": 4096} and m.architecture.n_layers == 2
    assert m.architecture.to_dict()["sliding_window"] == 4096


def test_every_file_the_loader_reads_is_listed(art):
    """Defect 7: native.json was used without being listed in the manifest; now every file the loader opens
    (index and kernel library included) is listed and hashed, and nothing else is in the artifact."""
    m = load_manifest(art, verify_files=False)
    on_disk = {p.name for p in art.iterdir()} - {"manifest.yaml"}
    assert on_disk == set(m.files)
    used = {m.tokenizer_file, m.graph_file} | ({m.graph_index, m.kernels.file} if m.backend == "native" else set())
    assert used <= set(m.files)
    good = (art / "manifest.yaml").read_text()
    for f in used:
        raw = yaml.safe_load(good)
        del raw["files"][f]
        (art / "manifest.yaml").write_text(yaml.safe_dump(raw))
        with pytest.raises(ArtifactError, match=f"{f} is used but not listed"):
            runtime.load(art)


def test_manifest_states_only_what_is_true(tiny_artifacts):
    """Defect 5: native manifests said kv_cache token-major for a layer-major backend, recorded an ignored
    accuracy_level, and dropped the index they had written."""
    nat = load_manifest(tiny_artifacts["native"])
    assert nat.kv_cache["layout"] == "layer-major" == runtime.BACKENDS["native"].kv_layout
    assert nat.quantization.accuracy_level is None and "accuracy_level" not in nat.to_dict()["quantization"]
    assert nat.graph_index == "native.json" and nat.kernels.file.endswith(".so")
    assert {"avx2", "fma", "f16c"} <= set(nat.kernels.cpu_features) <= set(runtime.native.cpu_features())
    ort = load_manifest(tiny_artifacts["onnxruntime"])
    assert ort.kv_cache["layout"] == "token-major" and ort.quantization.accuracy_level == 4
    assert ort.graph_index is None and ort.kernels is None
    idx = json.loads((tiny_artifacts["native"] / "native.json").read_text())
    assert idx["architecture"] == nat.architecture.to_dict()


def test_tokenizer_that_disagrees_with_the_vocab_is_refused(art):
    _rewrite(art, _arch(vocab=300))
    with pytest.raises(ArtifactError):
        runtime.load(art)


@pytest.mark.parametrize("template,msg", [("{% for %}", "does not parse"), ("{{ 1/0 }}", "ZeroDivisionError"),
                                          ("{{ foo.bar }}", "UndefinedError"), ('{{ "".__class__ }}', "SecurityError"),
                                          ("{% for i in range(100000000) %}{% endfor %}", "OverflowError")])
def test_broken_chat_template_is_one_line(art, template, msg):
    """Review: an edited chat_template gave ZeroDivisionError/UndefinedError/TemplateSyntaxError/OverflowError
    tracebacks; a template that fails to parse is refused at load, one that fails to render at the call."""
    _rewrite(art, lambda m: m.update(chat_template=template))
    if msg == "does not parse":
        with pytest.raises(ArtifactError, match="manifest chat_template: chat template does not parse"):
            runtime.load(art)
        return
    m = runtime.load(art)
    with pytest.raises(ValueError, match=f"chat template failed: .*{msg}") as e:
        m.chat([{"role": "user", "content": "hi"}])
    assert "\n" not in str(e.value)
