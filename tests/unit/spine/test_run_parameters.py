"""A run's parameters merge key by key into its deployment's defaults (Prefect alone replaces whole sections)."""

from __future__ import annotations

from factory.config import deployment_defaults, merge_run_parameters

DEPLOYMENT = {"config_path": "deployments/intern_bootcamp.yaml",
              "env": {"group_size": 16, "total_items": 1000},
              "datagen": {"chunk_items": 100, "run_id": "intern-bootcamp", "curriculum": {"enabled": True, "low": 0.2}}}


def test_a_section_given_for_a_run_changes_only_the_keys_it_names():
    merged = merge_run_parameters(DEPLOYMENT, {"env": {"total_items": 8}, "datagen": None})
    assert merged["env"] == {"group_size": 16, "total_items": 8}
    assert merged["datagen"] == DEPLOYMENT["datagen"]  # not given: the deployment's own


def test_nested_sections_merge_too_and_defaults_are_not_mutated():
    merged = merge_run_parameters(DEPLOYMENT, {"datagen": {"curriculum": {"low": 0.1}}})
    assert merged["datagen"]["curriculum"] == {"enabled": True, "low": 0.1}
    assert merged["datagen"]["chunk_items"] == 100
    assert DEPLOYMENT["datagen"]["curriculum"]["low"] == 0.2


def test_the_runs_full_section_from_prefect_merges_to_itself():
    """Prefect hands the run the deployment's value when the run did not set it: merging it changes nothing."""
    assert merge_run_parameters(DEPLOYMENT, {"env": dict(DEPLOYMENT["env"])})["env"] == DEPLOYMENT["env"]


def test_without_a_deployment_the_given_values_stand():
    assert merge_run_parameters({}, {"env": {"a": 1}, "openai": None}) == {"env": {"a": 1}, "openai": None}
    assert merge_run_parameters(None, {"env": None}) == {"env": None}


def test_a_plain_value_replaces_the_default():
    assert merge_run_parameters({"config_path": "a.yaml", "env": {"x": 1}},
                                {"config_path": "b.yaml", "env": "not-a-dict"}) == {"config_path": "b.yaml",
                                                                                     "env": "not-a-dict"}


def test_outside_a_flow_run_there_are_no_deployment_defaults():
    assert deployment_defaults() == {}


def test_outside_a_deployment_run_the_sections_given_stand_and_empty_ones_are_left_out():
    from factory.config import deployment_sections

    assert deployment_sections(train={"total_steps": 3}, source=None, push={}) == {"train": {"total_steps": 3}}
