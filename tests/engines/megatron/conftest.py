def pytest_configure(config):
    config.addinivalue_line("markers", "slow: spawns gloo ranks and trains Megatron models (tens of seconds)")
