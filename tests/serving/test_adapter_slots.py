"""AdapterSlots without Ray: leases, swaps, rollback and collection of unused versions."""

from __future__ import annotations

import threading

from osd.config import load_config
from osd.model_sources import attach_lora_adapters, load_model_pair
from serving.adapter_slots import AdapterSlots


def make_slots():
    config = load_config(None, ["model.target=toy:target", "model.draft=toy:draft"])
    _, draft, _ = load_model_pair(config.model)
    peft = attach_lora_adapters(draft, config.model, ["general@0"])
    return AdapterSlots(peft, ["general"]), config


def install_copy(model, name):
    from peft import LoraConfig

    model.add_adapter(name, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"]))


def test_leased_version_survives_two_swaps_and_is_collected_after_release():
    slots, _ = make_slots()
    slots.swap_in("general", 1, install_copy)
    lease = slots.acquire("general")
    slots.swap_in("general", 2, install_copy)
    slots.swap_in("general", 3, install_copy)
    assert "general@1" in slots.model.peft_config  # still leased
    assert slots.release(lease)  # general@1 is now unused
    slots.collect()
    # Version 0, the base draft, always stays: a rollback to it needs nothing loaded.
    assert sorted(slots.model.peft_config) == ["general@0", "general@2", "general@3"]
    assert (slots.current("general"), slots.previous("general")) == (3, 2)


def test_roll_back_restores_previous_and_unloads_the_loser():
    slots, _ = make_slots()
    slots.swap_in("general", 1, install_copy)
    assert slots.roll_back("general") == 0
    assert slots.current("general") == 0 and "general@1" not in slots.model.peft_config


def test_a_version_being_installed_is_never_collected_by_a_concurrent_release():
    slots, _ = make_slots()
    lease = slots.acquire("general")

    def finish_request():
        if slots.release(lease):
            slots.collect()

    finisher = threading.Thread(target=finish_request)

    def slow_install(model, name):
        install_copy(model, name)
        finisher.start()  # a request finishes while the new version is not yet current
        finisher.join(timeout=0.3)

    slots.swap_in("general", 1, slow_install)
    finisher.join()
    assert slots.current("general") == 1 and "general@1" in slots.model.peft_config


def test_release_says_when_a_version_is_left_to_unload():
    slots, _ = make_slots()
    slots.swap_in("general", 1, install_copy)
    first, second = slots.acquire("general"), slots.acquire("general")
    slots.swap_in("general", 2, install_copy)
    slots.swap_in("general", 3, install_copy)
    assert slots.release(first) is False  # still leased by the second
    assert slots.release(second) is True
    assert "general@1" in slots.model.peft_config  # releasing does not unload it
    slots.collect()
    assert sorted(slots.model.peft_config) == ["general@0", "general@2", "general@3"]


def test_base_draft_stays_loaded_for_a_rollback_to_it_after_many_versions():
    slots, _ = make_slots()
    for version in range(1, 5):
        slots.swap_in("general", version, install_copy)
    assert sorted(slots.model.peft_config) == ["general@0", "general@3", "general@4"]
    assert slots.roll_back("general", 0) == 0
    assert slots.current("general") == 0 and "general@4" not in slots.model.peft_config


def test_unloading_waits_for_forwards_without_blocking_leases():
    """A server's event loop acquires and releases leases; unloading, which waits for the
    forwards in progress, must not hold the lock they need meanwhile."""
    slots, _ = make_slots()
    slots.swap_in("general", 1, install_copy)
    lease = slots.acquire("general")
    slots.swap_in("general", 2, install_copy)
    slots.swap_in("general", 3, install_copy)
    assert slots.release(lease)  # general@1 is left to unload
    forward_running, forward_done = threading.Event(), threading.Event()

    def long_forward():
        with slots.model_lock.reading():
            forward_running.set()
            forward_done.wait(30)

    reader = threading.Thread(target=long_forward)
    reader.start()
    forward_running.wait(10)
    collector = threading.Thread(target=slots.collect)
    collector.start()  # waits for the forward to end
    leases = []
    event_loop = threading.Thread(target=lambda: leases.append(slots.acquire("general")))
    event_loop.start()
    event_loop.join(timeout=10)
    blocked = event_loop.is_alive()
    forward_done.set()
    for thread in (reader, collector, event_loop):
        thread.join(timeout=30)
    assert not blocked, "acquire waited for a forward to end"
    assert leases[0].version == 3
    assert "general@1" not in slots.model.peft_config


def test_swapping_in_an_older_version_follows_a_rollback_and_leaves_no_baseline():
    slots, _ = make_slots()
    slots.swap_in("general", 1, install_copy)
    slots.swap_in("general", 2, install_copy)
    slots.swap_in("general", 1, install_copy)  # the pointer moved back from 2 to 1
    assert (slots.current("general"), slots.previous("general")) == (1, None)
    assert "general@2" not in slots.model.peft_config
