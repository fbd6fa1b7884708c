"""The router's routing rules and settings, without servers: rendezvous hashing moves only a leaving
replica's sessions (checked against every session), prefix owners win until overloaded, the
least-loaded replica takes the rest, and the settings read TOML, the environment and flags in order."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pypto_serving.config import SettingsError
from pypto_serving.router import ReplicaConfig, RouterSettings, rendezvous_order, request_profile
from pypto_serving.router.config import load_router_settings
from pypto_serving.router.routing import ReplicaLoad, Router


def make_router(names: list[str], **overrides: object) -> Router:
    settings = RouterSettings(
        replicas=[{"url": f"http://h{i}:80", "name": n} for i, n in enumerate(names)], **overrides
    )
    return Router(settings, {n: ReplicaLoad(n, healthy=True) for n in names})


def test_a_leaving_replica_moves_only_its_own_sessions() -> None:
    names = [f"r{i}" for i in range(5)]
    router = make_router(names)
    sessions = [f"user-{i}" for i in range(2000)]
    before = {s: router.choose(request_profile({}, s, router.settings)) for s in sessions}
    assert all(c is not None and c.hit for c in before.values())
    counts = {n: sum(c is not None and c.replica == n for c in before.values()) for n in names}
    assert min(counts.values()) > 300, counts  # each replica gets about a fifth
    router.replicas["r2"].healthy = False
    for s, old in before.items():
        new = router.choose(request_profile({}, s, router.settings))
        assert new is not None and old is not None
        if old.replica == "r2":
            assert new.replica != "r2" and new.hit is False
            # the next replica in the session's own order, as rendezvous hashing defines it
            assert new.replica == next(n for n in rendezvous_order(s, names) if n != "r2")
        else:
            assert new.replica == old.replica and new.hit is True
    router.replicas["r2"].healthy = True
    assert all(router.choose(request_profile({}, s, router.settings)) == before[s] for s in sessions)


def test_prefix_owner_wins_until_it_is_overloaded() -> None:
    router = make_router(["a", "b"], prefix_overload_factor=2.0, prefix_overload_tokens=100)
    shared = "x" * 200
    first = request_profile({"prompt": shared + "one", "max_tokens": 10}, None, router.settings)
    assert len(first.block_hashes) == 3  # 203 characters: three whole 64-character blocks
    choice = router.choose(first)
    assert choice is not None and choice.reason == "least_tokens"
    router.started(choice.replica, first)
    owner = choice.replica
    other = "b" if owner == "a" else "a"
    second = request_profile({"prompt": shared + "two", "max_tokens": 10}, None, router.settings)
    # owner carries first's cost (about 61 tokens), the other 0: within 2 x 0 + 100.
    c = router.choose(second)
    assert c is not None and (c.replica, c.reason, c.hit) == (owner, "prefix", True)
    router.replicas[owner].outstanding_tokens = 101
    c = router.choose(second)
    assert c is not None and (c.replica, c.overloaded) == (other, True)
    router.replicas[other].outstanding_tokens = 1  # bound 2 x 1 + 100 = 102 >= 101
    c = router.choose(second)
    assert c is not None and c.replica == owner
    router.replicas[owner].drained = True
    c = router.choose(second)
    assert c is not None and (c.replica, c.hit) == (other, False)


def test_the_longest_shared_chain_decides() -> None:
    router = make_router(["a", "b"])
    base = "".join(random.Random(0).choice("abcdefgh") for _ in range(640))
    short = request_profile({"prompt": base[:128]}, None, router.settings)
    long = request_profile({"prompt": base}, None, router.settings)
    router.started("a", short)
    router.started("b", long)
    probe = request_profile({"prompt": base[:400] + "!"}, None, router.settings)
    router.replicas["a"].outstanding_tokens = router.replicas["b"].outstanding_tokens = 0
    c = router.choose(probe)
    assert c is not None and c.replica == "b"  # b holds 6 of probe's blocks, a only 2


def test_chat_turns_extend_the_previous_turns_chain() -> None:
    settings = RouterSettings()
    turn1 = [{"role": "user", "content": "tell me about the weather in spring"}]
    turn2 = [*turn1, {"role": "assistant", "content": "it rains"}, {"role": "user", "content": "and summer?"}]
    h1 = request_profile({"messages": turn1}, None, settings).block_hashes
    h2 = request_profile({"messages": turn2}, None, settings).block_hashes
    assert len(h1) == 1 and h2[:1] == h1 and len(h2) == 3  # one block per message
    other = [{"role": "user", "content": "tell me about the weather in autumn"}]
    assert request_profile({"messages": other}, None, settings).block_hashes != h1

    def ids(prompt: list[int]) -> tuple[bytes, ...]:
        return request_profile({"prompt": prompt}, None, settings).block_hashes

    assert len(ids(list(range(40)))) == 2  # two whole 16-id blocks
    assert ids(list(range(40)))[:1] == ids(list(range(16)) + [99] * 20)[:1] != ids(list(range(1, 41)))[:1]


def test_least_outstanding_tokens_and_costs() -> None:
    router = make_router(["a", "b", "c"])
    p = request_profile({"prompt": [1] * 100, "max_tokens": 50, "n": 2}, None, router.settings)
    assert p.cost == 300
    router.started("a", p)
    router.started("b", request_profile({"prompt": "hi", "max_tokens": 5}, None, router.settings))
    chosen = [router.choose(request_profile({"prompt": [7]}, None, router.settings)) for _ in range(3)]
    assert {c.replica for c in chosen if c is not None} == {"c"}
    router.finished("a", p)
    assert router.replicas["a"].outstanding_tokens == 0 and router.replicas["a"].in_flight == 0
    # idle replicas share sequential requests instead of the first taking all
    idle = make_router(["a", "b"])
    assert {c.replica for _ in range(4) if (c := idle.choose(request_profile({}, None, idle.settings)))} == {"a", "b"}
    assert request_profile("not a dict", None, router.settings).cost == 1
    default = request_profile({"prompt": [1, 2]}, None, router.settings)
    assert default.cost == 2 + router.settings.default_max_tokens


def test_nothing_routable_is_none() -> None:
    router = make_router(["a"])
    router.replicas["a"].drained = True
    assert router.choose(request_profile({}, "s", router.settings)) is None


def test_the_prefix_table_is_bounded() -> None:
    router = make_router(["a"], prefix_table_size=10)
    for i in range(20):
        router.started("a", request_profile({"prompt": f"{i:064d}" * 3}, None, router.settings))
    assert len(router._prefix_owner) == 10


def test_settings_from_toml_env_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "router.toml"
    path.write_text(
        'port = 9000\nadmin_token = "file"\nhealth_interval = 5\n'
        '[[replicas]]\nurl = "http://10.0.0.2:8000"\n'
        '[[replicas]]\nurl = "http://10.0.0.3:8000/"\nname = "b"\ncommand = ["pypto-serving", "serve"]\n'
    )
    monkeypatch.setenv("PYPTO_ROUTER_HEALTH_INTERVAL", "7")
    monkeypatch.setenv("PYPTO_ROUTER_ADMIN_TOKEN", "env")
    s = load_router_settings(path, admin_token="flag", replica_urls=["http://127.0.0.1:8001"])
    assert (s.port, s.admin_token, s.health_interval) == (9000, "flag", 7.0)
    assert [(r.name, r.url) for r in s.replicas] == [
        ("10.0.0.2:8000", "http://10.0.0.2:8000"),
        ("b", "http://10.0.0.3:8000"),
        ("127.0.0.1:8001", "http://127.0.0.1:8001"),
    ]
    assert s.replicas[1].command == ["pypto-serving", "serve"]
    monkeypatch.setenv("PYPTO_ROUTER_REPLICAS", '[{"url": "http://a:1", "name": "x"}]')
    monkeypatch.setenv("PYPTO_ROUTER_API_KEY", "k1,k2")
    s = load_router_settings(None, replica_urls=["http://b:2"])
    assert [r.name for r in s.replicas] == ["x", "b:2"] and s.api_key == ["k1", "k2"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replica_urls": ["ftp://x"]}, "not an http:// or https:// URL"),
        ({"replica_urls": ["http://h:1/v1"]}, "without a path"),
        ({"replica_urls": ["http://h:1", "http://h:1"]}, "unique"),
        ({"prefix_overload_factor": 0.5}, "prefix_overload_factor"),
        ({"api_key": ["", "x"], "admin_token": "secret-value"}, None),
    ],
)
def test_bad_settings_name_the_culprit(values: dict[str, object], message: str | None) -> None:
    if message is None:
        assert load_router_settings(None, **values).api_key == ["x"]
        return
    with pytest.raises(SettingsError, match=message):
        load_router_settings(None, **values)


def test_an_unknown_file_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text("replica = 3\n")
    with pytest.raises(SettingsError, match="unknown setting"):
        load_router_settings(path)
    assert ReplicaConfig(url="https://h").name == "h"


DOC = Path(__file__).resolve().parents[2] / "docs" / "router.md"


def test_every_router_setting_is_documented() -> None:
    text = DOC.read_text()
    for model in (RouterSettings, ReplicaConfig):
        for name, field in model.model_fields.items():
            assert f"| `{name}` |" in text, f"docs/router.md lacks {name}"
            assert field.description and field.description in text, f"docs/router.md: stale description of {name}"


def test_the_docs_router_files_load(tmp_path: Path) -> None:
    blocks = DOC.read_text().split("```toml\n")[1:]
    assert len(blocks) == 2
    loaded = []
    for i, block in enumerate(blocks):
        path = tmp_path / f"router{i}.toml"
        path.write_text(block.split("```")[0])
        loaded.append(load_router_settings(path))
    s, pairs = loaded
    assert [r.name for r in s.replicas] == ["local-a", "local-b", "gpu-host"]
    assert s.replicas[1].env == {"OMP_NUM_THREADS": "4"} and s.replicas[0].command is not None
    assert [r.role for r in pairs.replicas] == ["prefill", "decode"]


def test_the_command_refuses_a_router_without_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    from pypto_serving.cli import main

    assert main(["router", "--port", "0"]) == 2
    assert "no replicas" in capsys.readouterr().err
    assert main(["router", "--replica", "http://h:1/v1"]) == 2
    assert "without a path" in capsys.readouterr().err


def test_prefix_hashes_are_per_model() -> None:
    """A prefix shared under another model (a LoRA adapter, or the base) is no prefix-cache hit on the
    replica that served it, so it does not attract the request."""
    settings = RouterSettings(replicas=[ReplicaConfig(url="http://a")], prefix_block_tokens=2)
    prompt = {"prompt": list(range(8)), "max_tokens": 1}
    base = request_profile(prompt, None, settings).block_hashes
    adapter = request_profile({**prompt, "model": "style"}, None, settings).block_hashes
    again = request_profile({**prompt, "model": "style"}, None, settings).block_hashes
    assert len(base) == len(adapter) == 4
    assert not set(base) & set(adapter)
    assert adapter == again
