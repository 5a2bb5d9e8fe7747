"""The NCCL flight recorder's settings: what a rank is started with, for NCCL only."""

from trainer.runtime.distributed import flight_recorder_env


def test_nccl_flight_recorder_dumps_into_output_dir_and_is_off_for_gloo(tmp_path):
    assert flight_recorder_env("gloo", tmp_path) == {}
    env = flight_recorder_env("nccl", tmp_path)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{tmp_path}/nccl-trace/rank_"
