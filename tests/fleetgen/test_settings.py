"""Settings read the server's settings under their kind-neutral names and their older ones."""

from __future__ import annotations

from fleetgen.settings import Settings, setting


def test_the_server_settings_are_read_under_their_older_sglang_names_too() -> None:
    older = Settings.from_env({"SGLANG_URL": "http://gpu-box:30000/", "SGLANG_API_KEY": "k1",
                               "FLEETGEN_SGLANG_BASE_PORT": "31000"})
    assert (older.server_url, older.server_api_key, older.server_base_port) == (
        "http://gpu-box:30000", "k1", 31000)


def test_the_kind_neutral_name_wins_when_both_are_set() -> None:
    env = {"SGLANG_URL": "http://old:1", "FLEETGEN_SGLANG_URL": "http://older:2",
           "FLEETGEN_SERVER_URL": "http://new:3", "SGLANG_API_KEY": "old",
           "FLEETGEN_SERVER_API_KEY": "new", "FLEETGEN_SGLANG_BASE_PORT": "1",
           "FLEETGEN_SERVER_BASE_PORT": "2"}
    settings = Settings.from_env(env)
    assert (settings.server_url, settings.server_api_key, settings.server_base_port) == (
        "http://new:3", "new", 2)
    assert setting("server_api_key", env) == "new"
    assert setting("server_api_key", {"SGLANG_API_KEY": "old"}) == "old"
    assert setting("server_api_key", {}) is None


def test_the_producers_default_output_is_a_setting() -> None:
    assert Settings.from_env({"FLEETGEN_OUTPUT": "s3://bucket/runs"}).output == "s3://bucket/runs"
    assert Settings.from_env({}).output is None
