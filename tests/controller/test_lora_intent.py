"""The fleet's LoRA intent (controller/lora_intent.py) remembers an unload while an engine it
was for may still hold the adapter (away during the unload: stopped, cut off, not read yet),
and only so long: each engine answering it, read without the adapter or leaving the fleet
ends that, so a fleet unloading ever new names does not remember them all."""

from __future__ import annotations

from controller.lora_intent import LoraIntent, LoraSpec, SharedLora

X = LoraSpec(1, "x", "/adapters/x")


def test_an_engine_away_during_an_unload_keeps_it_unloaded_until_read_without_it() -> None:
    intent = LoraIntent()
    intent.loaded(X, None)
    intent.unloaded("x", None, ["a", "b"])
    intent.unload_confirmed("x", "a")  # b is away: it did not answer
    assert intent.found_on("b", [X], ["a", "b"]) == []  # back, holding x
    assert intent.wanted_on("a", ["m"]) == [] and "x" in intent.unloaded_from
    intent.found_on("b", [], ["a", "b"])  # a new process of b, without x
    assert intent.unloaded_from == {} and intent.unconfirmed == {}
    intent.found_on("c", [X], ["a", "b", "c"])  # one met later holding x: its own
    assert intent.wanted_on("c", ["m"]) == [X] and intent.wanted_on("a", ["m"]) == []


def test_an_unload_is_forgotten_once_the_engine_away_leaves_the_fleet() -> None:
    intent = LoraIntent()
    intent.loaded(X, "b")
    intent.unloaded("x", "b", ["a", "b"])
    assert intent.unloaded_from == {"x": {"b"}}
    intent.forget_engine("b")
    assert intent.unloaded_from == {} and intent.unconfirmed == {}


def test_an_unload_waits_for_no_engine_read_serving_no_lora() -> None:
    intent = LoraIntent()
    intent.found_on("plain", None, ["plain", "a"])
    intent.loaded(X, None)
    intent.unloaded("x", None, ["plain", "a"])
    intent.unload_confirmed("x", "a")
    assert intent.unloaded_from == {} and intent.unconfirmed == {}


def test_an_engine_kept_off_a_fleet_wide_adapter_stays_off_it() -> None:
    intent = LoraIntent()
    intent.loaded(X, None)
    intent.unloaded("x", "a", ["a", "b"])
    intent.unload_confirmed("x", "a")
    assert intent.wanted_on("a", ["m"]) == [] and intent.wanted_on("b", ["m"]) == [X]
    intent.loaded(X, "a")  # loaded there again: no exclusion left
    assert intent.unloaded_from == {} and intent.wanted_on("a", ["m"]) == [X]


def test_a_fleet_wide_adapter_for_a_model_is_wanted_only_where_that_model_is_served() -> None:
    intent = LoraIntent()
    intent.loaded(X, None, "a")
    assert intent.wanted_on("b0", ["b"]) == [] and intent.wanted_on("a0", ["a", "a-chat"]) == [X]
    assert intent.model_conflict("x", "b") == "a" and intent.model_conflict("x", "a") is None
    intent.unloaded("x", None, ["a0", "b0"])
    intent.loaded(X, None, "b")  # unloaded, then loaded for another model
    assert intent.wanted_on("a0", ["a"]) == [] and intent.wanted_on("b0", ["b"]) == [X]


def test_an_adapter_found_on_every_engine_of_one_model_is_that_models() -> None:
    """Found on a0 and a1, not on b0 (read first or in between): the fleet's for `a`, and
    b0 read without it does not make it a0's and a1's own."""
    for order in (["b0", "a0", "a1"], ["a0", "b0", "a1"]):
        intent = LoraIntent()
        fleet = ["a0", "a1", "b0"]
        for address in order:
            intent.found_on(address, [] if address == "b0" else [X], fleet, address[0])
        assert intent.models == {"x": "a"}, order
        assert intent.wanted_on("a2", ["a"]) == [X] and intent.wanted_on("b1", ["b"]) == []
        assert intent.undecided == {} and intent.undecided_models == {}


def test_a_load_on_one_engine_for_a_model_names_it_again_there_until_unloaded() -> None:
    """`lora load --engine ctl --model a` (ctl a controller fronted as an engine, serving `a`
    and `b`): restored on ctl, the load names `a` again, as the first did; the model goes
    with the engine's load (its unload, the engine leaving, the load again naming none)."""
    intent = LoraIntent()
    intent.loaded(X, "ctl", "a")
    assert intent.wanted_on("ctl", ["a", "b"]) == [X] and intent.model_of("x", "ctl") == "a"
    assert intent.models == {}  # not the fleet's: no other engine wants it
    intent.loaded(X, "ctl")
    assert intent.model_of("x", "ctl") is None
    intent.loaded(X, "ctl", "b")
    intent.unloaded("x", "ctl", ["ctl"])
    assert intent.model_of("x", "ctl") is None and intent.engine_models == {}
    intent.loaded(X, "ctl", "a")
    intent.forget_engine("ctl")
    assert intent.engine_models == {}
    intent.loaded(X, "ctl", "a")
    intent.unloaded("x", None, ["ctl"])
    assert intent.engine_models == {}


def test_another_replicas_loads_and_unloads_are_adopted_as_its_intent_holds_them() -> None:
    """What one replica's intent holds for a name (`shared`), adopted by another's: the same
    engines want it, for the same models, and its unload there forgets it."""
    y = LoraSpec(2, "y", "/adapters/y")
    one, other = LoraIntent(), LoraIntent()
    one.loaded(X, None, "m")
    one.unloaded("x", "b", ["a", "b", "c"])  # kept off b
    one.loaded(y, "c", "n")
    assert one.shared("x") == SharedLora(X, {None: "m"}, frozenset({"b"}), {None: 1})
    for name in "xy":
        other.adopt(name, one.shared(name))
    for address in "abc":
        assert other.wanted_on(address, ["m"]) == one.wanted_on(address, ["m"])
    assert other.model_of("y", "c") == "n" and other.model_of("x", "a") == "m"
    one.unloaded("x", None, ["a", "b", "c"])
    assert one.shared("x") is None
    other.adopt("x", one.shared("x"))
    assert other.wanted_on("a", ["m"]) == [] and other.wanted_on("c", ["m"]) == [y]


def test_a_replica_adopting_another_replicas_loads_keeps_the_order_they_were_loaded_in() -> None:
    """y loaded on the fleet, x on engine a, then z and x on the fleet through one replica:
    another adopting them name by name, in whatever order (the membership hash's fields
    are in no particular order), wants them on each engine in the order they were loaded,
    as the first does (an engine out of LoRA slots gets those loaded first). Before, it
    wanted them in the order it adopted them."""
    y, z = LoraSpec(2, "y", "/adapters/y"), LoraSpec(3, "z", "/adapters/z")
    one = LoraIntent()
    one.loaded(y, None)
    one.loaded(X, "a")
    one.loaded(z, None)
    one.loaded(X, None)
    assert one.wanted_on("a", ["m"]) == [y, X, z]
    assert one.wanted_on("b", ["m"]) == [y, z, X]
    for names in ("xyz", "zyx", "yzx"):
        other = LoraIntent()
        for name in names:
            other.adopt(name, one.shared(name))
        for address in "ab":
            assert other.wanted_on(address, ["m"]) == one.wanted_on(address, ["m"]), names
        # A load through the other replica, which has read them, comes after them all.
        w = LoraSpec(4, "w", "/adapters/w")
        other.loaded(w, None)
        assert other.wanted_on("b", ["m"]) == [y, z, X, w]
        assert other.shared("w") == SharedLora(w, {None: None}, seqs={None: 5})


def test_a_replica_holding_loads_places_those_it_adopts_among_them_by_their_numbers() -> None:
    """Replicas one and two load y and z, each before reading the other's; two then adopts
    one's y, numbered between its own z and w, and one's x, unloaded and loaded again (last
    now): two wants them in the order of their numbers, as a replica adopting them all
    afresh does, and an adapter loaded again moves to the end."""
    y, z, w = (LoraSpec(i, n, f"/adapters/{n}") for i, n in ((2, "y"), (3, "z"), (4, "w")))
    one, two = LoraIntent(), LoraIntent()
    one.loaded(X, None)  # 1
    one.loaded(y, None)  # 2
    two.loaded(z, None)  # 1
    two.adopt("x", one.shared("x"))  # x 1, z 1: by name
    two.loaded(w, None)  # 2
    two.adopt("y", one.shared("y"))  # y 2, w 2: by name
    assert two.wanted_on("a", ["m"]) == [X, z, w, y]
    one.unloaded("x", None, ["a"])
    one.loaded(X, None)  # 3: after y
    two.adopt("x", one.shared("x"))
    assert two.wanted_on("a", ["m"]) == [z, w, y, X]
    fresh = LoraIntent()
    for name, intent in (("x", one), ("w", two), ("y", one), ("z", two)):
        fresh.adopt(name, intent.shared(name))
    assert fresh.wanted_on("a", ["m"]) == two.wanted_on("a", ["m"])


def test_an_adapter_found_on_engines_that_all_left_is_held_for_no_model() -> None:
    """x found on a (serving m1) while b was not read yet; a and b leave: x is loaded
    nowhere, and held for no model (it was m1's: a load of it for m2 was refused)."""
    intent = LoraIntent()
    assert intent.found_on("a", [X], ["a", "b"], "m1") == []
    intent.forget_engine("a")
    intent.forget_engine("b")
    assert intent.shared("x") is None
    assert intent.model_conflict("x", "m2") is None and intent.models == {}


def test_an_adapter_loaded_on_one_engine_is_held_for_that_engines_model() -> None:
    """x loaded on a (serving m1) alone, or found there: a load of it for m2 conflicts, as
    one for m1 does not; the model a load named on an engine decides over its base model."""
    base = {"a": "m1", "ctl": None}.get
    intent = LoraIntent()
    intent.loaded(X, "a")
    assert intent.model_conflict("x", "m2", base) == "m1"
    assert intent.model_conflict("x", "m1", base) is None
    found = LoraIntent()
    found.found_on("a", [X], ["a", "b"], "m1")  # b not read yet: a's own
    assert found.model_conflict("x", "m2", base) == "m1"
    fronted = LoraIntent()
    fronted.loaded(X, "ctl", "m2")
    assert fronted.model_conflict("x", "m1", base) == "m2"
    assert fronted.model_conflict("x", "m2", base) is None


def test_an_adapter_found_on_engines_of_two_models_is_its_holders_own() -> None:
    """x found on a0, a1 (serving m1) and b0 (serving m2), in either order: it was the
    fleet's for the model of the engine read first, b0's (or a0's and a1's) x forgotten. It
    is each holder's own, held for its model: a load of it for either model conflicts."""
    base = {"a0": "m1", "a1": "m1", "b0": "m2"}.get
    fleet = ["a0", "a1", "b0"]
    for order in (fleet, fleet[::-1]):
        intent = LoraIntent()
        for address in order:
            intent.found_on(address, [X], fleet, base(address))
        seqs: dict[str | None, int] = {a: seq for seq, a in enumerate(order, start=1)}
        assert intent.shared("x") == SharedLora(X, dict.fromkeys(order), seqs=seqs)
        assert intent.model_conflict("x", "m1", base) == "m2"
        assert intent.model_conflict("x", "m2", base) == "m1"
        assert intent.models == {}


def test_an_engine_removed_and_registered_again_is_given_the_adapters_kept_off_it() -> None:
    """x loaded on the fleet, unloaded from b alone: b is kept off it until it leaves the
    fleet. Registered again, b is an engine joining: it is given x, as any other."""
    intent = LoraIntent()
    intent.loaded(X, None)
    intent.unloaded("x", "b", ["a", "b"])
    intent.unload_confirmed("x", "b")
    assert intent.wanted_on("b", ["m"]) == []
    intent.forget_engine("b")
    assert intent.wanted_on("b", ["m"]) == [X]
