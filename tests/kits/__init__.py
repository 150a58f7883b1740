"""What tests of every tier share: process groups (`procs`), an etcd server (`etcdserver`), an
in-process swarm of data planes (`swarmlet`), legacy certificates (`legacy_tls`), and factories
for the round engine, the coordinator's service, the `shoal` command and the README's blocks.
The root conftest puts tests/ on sys.path, so a test imports them as `kits.<module>`."""
