"""The gRPC message limit from MESHRL_GRPC_MAX_MESSAGE_MB."""

from concurrent import futures

import grpc
import pytest

from meshrl.rpc.options import max_message_bytes


def test_default_and_fractions_of_mib():
    assert max_message_bytes(None) == max_message_bytes("") == 512 * 2**20
    assert max_message_bytes("1.5") == 3 * 2**19


@pytest.mark.parametrize("mib", ["2048", "4096", "inf"])
def test_limits_past_two_gib_become_grpcs_ceiling(mib):
    # 2048 used to reach gRPC as 2**31 and fail every server and channel with
    # "OverflowError: value too large to convert to int".
    limit = max_message_bytes(mib)
    assert limit == 2**31 - 1
    server = grpc.server(
        futures.ThreadPoolExecutor(1), options=[("grpc.max_receive_message_length", limit)]
    )
    server.stop(None)


@pytest.mark.parametrize("raw", ["512MB", "0", "-1", "nan"])
def test_bad_values_name_the_variable(raw):
    with pytest.raises(ValueError, match="MESHRL_GRPC_MAX_MESSAGE_MB"):
        max_message_bytes(raw)
