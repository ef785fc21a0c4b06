"""Stand-in for requests in the gt suite's --lite carry (prepare_carry.sh).

probeinterface imports it at module level to download probe files, which the
suite never does (the device machine has no network)."""
__version__ = '0+gt-suite-stub'


def __getattr__(name):
    if name.startswith('__'):
        raise AttributeError(name)
    raise RuntimeError(f'requests.{name}: requests is a stub here (gt suite --lite carry)')
