"""Loading refuses bad artifacts with a message that names the file and what was expected."""
import shutil
import tarfile

import pytest
import yaml

import runtime
from runtime.artifact import FORMAT_VERSION, ArtifactError


@pytest.fixture()
def art(tiny_artifact, tmp_path):
    d = tmp_path / "a"
    shutil.copytree(tiny_artifact, d)
    return d


def _edit_manifest(d, fn):
    p = d / "manifest.yaml"
    m = yaml.safe_load(p.read_text())
    fn(m)
    p.write_text(yaml.safe_dump(m, sort_keys=False))


def test_good_artifact_loads(art):
    m = runtime.load(art)
    assert m.manifest.format_version == FORMAT_VERSION and m.manifest.backend == "onnxruntime"


def _graph(d):
    return yaml.safe_load((d / "manifest.yaml").read_text())["graph"]["file"]


def test_flipped_byte_is_rejected(art):
    p = art / (_graph(art) + ".data")
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x01
    p.write_bytes(bytes(b))
    with pytest.raises(ArtifactError, match=r"\.onnx\.data: sha256 .* manifest says .* tampered"):
        runtime.load(art)


def test_truncated_file_is_rejected(art):
    p = art / "tokenizer.bpe"
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(ArtifactError, match=r"tokenizer\.bpe: size \d+ bytes, manifest says \d+"):
        runtime.load(art)


def test_missing_file_is_rejected(art):
    g = _graph(art)
    (art / g).unlink()
    with pytest.raises(ArtifactError, match=f"file {g} listed in the manifest is missing"):
        runtime.load(art)


def test_unlisted_graph_is_rejected(art):
    g = _graph(art)
    _edit_manifest(art, lambda m: m["files"].pop(g))
    with pytest.raises(ArtifactError, match=f"{g} is used but not listed"):
        runtime.load(art)


def test_wrong_format_version_is_rejected(art):
    _edit_manifest(art, lambda m: m.update(format_version=99))
    with pytest.raises(ArtifactError, match=f"format_version 99 is not supported; this runtime reads version {FORMAT_VERSION}"):
        runtime.load(art)


def test_wrong_target_is_rejected(art):
    _edit_manifest(art, lambda m: m["target"].update(board="pi5", triple="aarch64-linux-gnu"))
    with pytest.raises(runtime.BoardMismatch, match="built for board 'pi5'.*rebuild with --board"):
        runtime.load(art)


def test_wrong_field_type_and_missing_field(art):
    _edit_manifest(art, lambda m: m.update(max_context="lots"))
    with pytest.raises(ArtifactError, match="field 'max_context' should be int, found str"):
        runtime.load(art)
    _edit_manifest(art, lambda m: m.pop("backend"))
    with pytest.raises(ArtifactError, match="missing field 'backend'"):
        runtime.load(art)


def test_path_escaping_file_name_is_rejected(art):
    _edit_manifest(art, lambda m: m["files"].update({"../etc/passwd": {"size": 1, "sha256": "0" * 64}}))
    with pytest.raises(ArtifactError, match="not a plain file name"):
        runtime.load(art)


def test_not_yaml_and_not_an_artifact(art, tmp_path):
    (art / "manifest.yaml").write_text("format_version: [1\n")
    with pytest.raises(ArtifactError, match="not valid YAML"):
        runtime.load(art)
    with pytest.raises(ArtifactError, match="no manifest.yaml"):
        runtime.load(tmp_path)
    with pytest.raises(ArtifactError, match="artifact not found"):
        runtime.load(tmp_path / "nope")


def test_tarball_loads(art, tmp_path):
    tar = tmp_path / "a.tar.gz"
    with tarfile.open(tar, "w:gz") as tf:
        tf.add(art, arcname="tiny")
    m = runtime.load(tar)
    assert m.manifest.model_name == "tiny-random-llama"


def test_native_index_that_does_not_match_the_architecture_is_rejected(tiny_artifacts, tmp_path):
    """A consistent manifest (hashes updated) whose tensor index disagrees with the model's shapes must not
    reach the C code, which would read past the tensor."""
    import json

    from runtime.artifact import load_manifest, write_manifest

    d = tmp_path / "n"
    shutil.copytree(tiny_artifacts["native"], d)
    idx = json.loads((d / "native.json").read_text())
    idx["tensors"]["blk.1.ffn_down.weight"][1] -= 160  # one group block short
    (d / "native.json").write_text(json.dumps(idx))
    m = load_manifest(d, verify_files=False).to_dict()
    files = list(m.pop("files")), m.pop("format_version")
    write_manifest(d, m, files[0])
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_down\.weight is Q4_1x8, \d+ bytes .* expected Q4_1x8, \d+ bytes"):
        runtime.load(d)


def test_cli_rebuilds_a_default_artifact_of_an_older_format(tmp_path):
    """The CLI's cached default artifact is rebuilt, not failed on, after an upgrade changes the format."""
    from runtime.cli import _stale

    d = tmp_path / "default"
    d.mkdir()
    assert _stale(d) is None  # missing: built, not "stale"
    (d / "manifest.yaml").write_text("format_version: 1\n")
    assert "format 1" in _stale(d) and f"reads {FORMAT_VERSION}" in _stale(d)
    (d / "manifest.yaml").write_text(f"format_version: {FORMAT_VERSION}\n")
    assert _stale(d) is None


def test_native_index_of_an_older_format_asks_for_a_rebuild(tiny_artifacts, tmp_path):
    import json

    from runtime.artifact import load_manifest, write_manifest

    d = tmp_path / "old"
    shutil.copytree(tiny_artifacts["native"], d)
    idx = json.loads((d / "native.json").read_text())
    (d / "native.json").write_text(json.dumps({"tensors": idx["tensors"]}))  # format 1 had no "format"
    m = load_manifest(d, verify_files=False).to_dict()
    files = list(m.pop("files")), m.pop("format_version")
    write_manifest(d, m, files[0])
    with pytest.raises(ValueError, match=r"native\.json: format \? .* rebuild the artifact"):
        runtime.load(d)


def test_damaged_unpacked_copy_of_a_tarball_is_unpacked_again(art, tmp_path, monkeypatch):
    """Review: a cached unpacked copy that no longer matched its manifest made its tarball unloadable for
    good; the loader now discards it and unpacks once more."""
    monkeypatch.setenv("BOARDTALK_CACHE", str(tmp_path / "cache"))
    tar = tmp_path / "a.tar.gz"
    with tarfile.open(tar, "w:gz") as tf:
        tf.add(art / "manifest.yaml", arcname="tiny/manifest.yaml")
        for f in sorted(art.iterdir()):
            if f.name != "manifest.yaml":
                tf.add(f, arcname=f"tiny/{f.name}")
    m = runtime.load(tar)
    (unpacked,) = [p for p in (tmp_path / "cache" / "unpacked").iterdir() if p.is_dir()]  # not its lock file
    graph = unpacked / m.manifest.graph_file
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    assert runtime.load(tar).manifest.model_name == "tiny-random-llama"
