#!/usr/bin/env bash
# Two "nodes" on one machine: two network namespaces joined by a veth pair, each with its own address.
#
#   bash scripts/netns_nodes.sh up NAME     # namespaces NAME-a (10.N.0.1) and NAME-b (10.N.0.2); prints them
#   bash scripts/netns_nodes.sh down NAME   # remove both (and the veth pair with them)
#
# Run a command on a node with `ip netns exec NAME-a CMD`. Needs root and iproute2 (installed with apt-get
# when missing). The subnet 10.N.0.0/24 is derived from NAME so that several pairs can coexist. Idempotent.
set -euo pipefail
cmd="${1:-}" name="${2:-ddpkit}"
[ ${#name} -le 10 ] || { echo "netns_nodes: NAME at most 10 characters (interface names are short)" >&2; exit 2; }
net=$(( $(printf '%s' "$name" | cksum | cut -d' ' -f1) % 200 + 20 ))
a="$name-a" b="$name-b"

need_ip() {
  command -v ip >/dev/null && return 0
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || { echo "netns_nodes: needs iproute2 (ip)" >&2; exit 3; }
  # One apt-get at a time (the test suite's other set-ups may install at the same moment): flock.
  flock -w 900 /tmp/ddpkit-apt.lock sh -c \
    'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2' >/dev/null
}

up() {
  need_ip
  [ "$(id -u)" = 0 ] || { echo "netns_nodes: network namespaces need root" >&2; exit 3; }
  if ! ip netns list | grep -qx "$a\( .*\)\?" || ! ip netns list | grep -qx "$b\( .*\)\?" \
      || ! ip netns exec "$a" ip -4 addr show | grep -q "10.$net.0.1/"; then
    down 2>/dev/null || true
    ip netns add "$a"
    ip netns add "$b"
    ip link add "$name-va" type veth peer name "$name-vb"
    ip link set "$name-va" netns "$a"
    ip link set "$name-vb" netns "$b"
    ip -n "$a" addr add "10.$net.0.1/24" dev "$name-va"
    ip -n "$b" addr add "10.$net.0.2/24" dev "$name-vb"
    for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
    ip -n "$a" link set "$name-va" up
    ip -n "$b" link set "$name-vb" up
  fi
  echo "$a 10.$net.0.1 $name-va"
  echo "$b 10.$net.0.2 $name-vb"
}

down() {
  ip netns del "$a" 2>/dev/null || true
  ip netns del "$b" 2>/dev/null || true
}

case "$cmd" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down [NAME]" >&2; exit 2 ;;
esac
