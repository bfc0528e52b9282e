import warnings

import pytest

from mpitrain.core import config


def test_defaults_without_environment():
    cfg = config.load({})
    assert cfg == config.Config()
    assert cfg.fusion_threshold == 64 * 1024 * 1024
    assert cfg.allreduce_algorithm == "auto"


def test_canonical_names_and_aliases():
    cfg = config.load({"HOROVOD_FUSION_THRESHOLD": "1024", "PERSEUS_ALLREDUCE_STREAMS": "3",
                       "HOROVOD_CYCLE_TIME": "2.5", "MPITRAIN_LOCAL_SIZE": "2"})
    assert (cfg.fusion_threshold, cfg.allreduce_streams, cfg.cycle_time_ms, cfg.local_size) == (
        1024, 3, 2.5, 2)


def test_canonical_name_beats_alias():
    cfg = config.load({"MPITRAIN_FUSION_THRESHOLD": "10", "HOROVOD_FUSION_THRESHOLD": "20"})
    assert cfg.fusion_threshold == 10


def test_explicit_override_beats_environment():
    cfg = config.load({"MPITRAIN_FUSION_THRESHOLD": "10"}, fusion_threshold=5)
    assert cfg.fusion_threshold == 5


def test_unknown_override_is_a_type_error():
    with pytest.raises(TypeError, match="no_such_field"):
        config.load({}, no_such_field=1)


@pytest.mark.parametrize(("name", "value"), [
    ("MPITRAIN_FUSION_THRESHOLD", "lots"),
    ("MPITRAIN_ALLREDUCE_STREAMS", "0"),
    ("MPITRAIN_ALLREDUCE_ALGORITHM", "fastest"),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "maybe"),
    ("MPITRAIN_CYCLE_TIME", "-1"),
    ("MPITRAIN_LOG_LEVEL", "loud"),
])
def test_bad_value_warns_naming_variable_and_value(name, value):
    with pytest.warns(RuntimeWarning) as record:
        cfg = config.load({name: value})
    message = str(record[0].message)
    assert name in message and repr(value) in message
    assert cfg == config.Config()  # the default is kept


def test_horovod_hierarchical_flag_selects_the_algorithm():
    assert config.load({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}).allreduce_algorithm == \
        "hierarchical"
    explicit = config.load({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
                            "MPITRAIN_ALLREDUCE_ALGORITHM": "ring"})
    assert explicit.allreduce_algorithm == "ring"


def test_config_is_frozen():
    cfg = config.load({})
    with pytest.raises(AttributeError):
        cfg.fusion_threshold = 1  # type: ignore[misc]


def test_every_variable_is_documented_and_maps_to_a_field():
    fields = set(config.Config.__dataclass_fields__)
    names = [v.name for v in config.VARIABLES]
    assert len(names) == len(set(names))
    for var in config.VARIABLES:
        assert var.field in fields and var.name.startswith("MPITRAIN_") and var.help
    assert {row[0] for row in config.describe()} == set(names)


def test_good_values_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.load({"MPITRAIN_ALLREDUCE_ALGORITHM": "RING", "MPITRAIN_BIND_DEVICE": "no"})


def test_autotune_variables_and_their_horovod_names():
    cfg = config.load({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "/tmp/t.csv",
                       "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0",
                       "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4",
                       "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "7"})
    assert (cfg.autotune, cfg.autotune_log, cfg.autotune_warmup_samples,
            cfg.autotune_steps_per_sample, cfg.autotune_max_samples) == (
        True, "/tmp/t.csv", 0, 4, 7)
    defaults = config.load({})
    assert (defaults.autotune, defaults.autotune_warmup_samples,
            defaults.autotune_steps_per_sample, defaults.autotune_max_samples) == (
        False, 3, 10, 20)  # Horovod's defaults
    assert config.load({"MPITRAIN_AUTOTUNE_MAX_SAMPLES": "3",
                        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "9"}).autotune_max_samples == 3


@pytest.mark.parametrize(("name", "value"), [
    ("MPITRAIN_AUTOTUNE", "sometimes"),
    ("HOROVOD_AUTOTUNE", "2"),
    ("MPITRAIN_AUTOTUNE_WARMUP_SAMPLES", "-1"),
    ("MPITRAIN_AUTOTUNE_STEPS_PER_SAMPLE", "0"),
    ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "many"),
])
def test_bad_autotune_values_name_variable_and_value(name, value):
    with pytest.warns(RuntimeWarning) as record:
        cfg = config.load({name: value})
    message = str(record[0].message)
    assert name in message and repr(value) in message
    assert cfg == config.Config()


def test_explicit_records_what_was_given():
    with pytest.warns(RuntimeWarning, match="MPITRAIN_CYCLE_TIME"):  # ignored: not given
        cfg = config.load({"HOROVOD_FUSION_THRESHOLD": "1024", "MPITRAIN_CYCLE_TIME": "bad"},
                          allreduce_streams=2)
    assert cfg.explicit == {"fusion_threshold", "allreduce_streams"}


def test_disagreements_name_the_variable_and_who_holds_each_value():
    fields = config.MUST_AGREE
    same = [getattr(config.Config(), f) for f in fields]
    assert config.disagreements([same, same, same]) == []
    ring = list(same)
    ring[fields.index("allreduce_algorithm")] = "ring"
    ring[fields.index("allreduce_streams")] = 2
    lines = config.disagreements([ring, ring, same, ring, ring, ring])
    assert lines == ["MPITRAIN_ALLREDUCE_ALGORITHM: 'ring' on ranks 0-1, 3-5, 'auto' on rank 2",
                     "MPITRAIN_ALLREDUCE_STREAMS: 2 on ranks 0-1, 3-5, 1 on rank 2"]


def test_every_setting_that_must_agree_is_a_variable():
    assert set(config.MUST_AGREE) <= {var.field for var in config.VARIABLES}


def test_deterministic_values():
    assert config.load({}).deterministic == ""
    for off in ("0", "off", "false", ""):
        assert config.load({"MPITRAIN_DETERMINISTIC": off}).deterministic == ""
    assert config.load({"MPITRAIN_DETERMINISTIC": "1"}).deterministic == \
        config.DETERMINISTIC_DEFAULT
    for mode in config.DETERMINISTIC_MODES:
        assert config.load({"MPITRAIN_DETERMINISTIC": mode.upper()}).deterministic == mode
    with pytest.warns(RuntimeWarning, match=r"MPITRAIN_DETERMINISTIC='exact'.*rank-order"):
        assert config.load({"MPITRAIN_DETERMINISTIC": "exact"}).deterministic == ""
    assert "deterministic" in config.MUST_AGREE


def test_start_timeout_and_its_horovod_name():
    assert config.load({}).start_timeout == 0.0  # off: a long load before init() is allowed
    assert config.load({"HOROVOD_START_TIMEOUT": "30"}).start_timeout == 30.0
    assert config.load({"MPITRAIN_START_TIMEOUT": "2.5",
                        "HOROVOD_START_TIMEOUT": "30"}).start_timeout == 2.5
    with pytest.warns(RuntimeWarning, match=r"MPITRAIN_START_TIMEOUT='-1'"):
        assert config.load({"MPITRAIN_START_TIMEOUT": "-1"}).start_timeout == 0.0
