"""`lily-engine serve --device wgpu` (WGSL kernels; Mesa's lavapipe in CI) against the CPU backend
on the synthetic `small` model: the same greedy replies through the whole HTTP stack, and the
same again when a request resumes from a saved conversation state (GPU snapshots).

Skipped where no Vulkan driver is installed, except under CI=true (scripts/test.sh installs
lavapipe there), where that is a failure.
"""

import glob
import os

import pytest

from conftest import CTX, Server

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def vulkan_driver_present() -> bool:
    dirs = ["/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d"]
    return any(glob.glob(os.path.join(d, "*.json")) for d in dirs)


@pytest.fixture(scope="module")
def wgpu_server(small_model):
    if not vulkan_driver_present():
        if os.environ.get("CI") in ("true", "1"):
            pytest.fail("CI needs a Vulkan driver (apt-get install mesa-vulkan-drivers libvulkan1)")
        pytest.skip("no Vulkan driver here")
    server = Server(str(small_model), "--ctx-size", str(CTX), "--device", "wgpu").wait_ready(timeout=300)
    yield server
    server.stop()


def greedy(server, messages, max_tokens):
    return server.client().chat.completions.create(
        model="small", messages=messages, temperature=0, max_tokens=max_tokens, extra_body=NO_THINKING)


def test_wgpu_greedy_replies_equal_the_cpu_backend(cpu_server, wgpu_server):
    for prompt in ("Name three colours.", "Tell me a story about a fox."):
        messages = [{"role": "user", "content": prompt}]
        want = greedy(cpu_server, messages, 12)
        got = greedy(wgpu_server, messages, 12)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
        assert got.usage.completion_tokens == want.usage.completion_tokens


def test_wgpu_resumed_conversation_equals_a_fresh_one(cpu_server, wgpu_server):
    first = [{"role": "user", "content": "Hello there"}]
    reply = greedy(wgpu_server, first, 6).choices[0].message.content
    turn2 = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    got = greedy(wgpu_server, turn2, 8)
    # The second turn resumed from the state the first one saved on the GPU.
    assert got.usage.prompt_tokens_details.cached_tokens > 0
    want = greedy(cpu_server, turn2, 8)
    assert got.choices[0].message.content == want.choices[0].message.content
