"""Reuseport group membership, as the kernel keeps it, and the steering routes it asks for.

Each proxy port is one reuseport group: the sockets of the workers (and, for UDP, the control
process's own) in the order the kernel keeps them. A join appends; a leave moves the last
socket into the leaver's place. From that order `steering.route_for` computes, per group,
where the kernel must send each worker's clients, so that a client IP always lands on the
same worker. Bookkeeping only: the publisher sends what this computes.
"""

from __future__ import annotations

from kube_userspace_proxy.dataplane import steering
from kube_userspace_proxy.model import SocketKey
from kube_userspace_proxy.workers.protocol import Routes

CONTROL = -1
"""The member id of the control process's own (UDP) socket in a reuseport group."""


class Groups:
    """Every reuseport group's members in the kernel's order, and the route its program has."""

    def __init__(self, workers: int) -> None:
        self._workers = workers
        self._members: dict[SocketKey, list[int]] = {}
        # The route whose program each group holds now, as last given to a worker (a group
        # of one socket needs none: it gets every connection). Attaching one costs the kernel
        # a compile (~20-80 us): not again for the same route, 10,000 times per start.
        self._programs: dict[SocketKey, tuple[int, ...]] = {}

    def add_port(self, key: SocketKey) -> None:
        """The control process reserved `key`: a bound UDP socket is in the group from its
        bind on (a handed-over one already is)."""
        members = self._members.setdefault(key, [])
        if key[0] == "UDP" and CONTROL not in members:
            members.append(CONTROL)
        if not members:
            del self._members[key]
            self._programs.pop(key, None)

    def join(self, key: SocketKey, member: int) -> None:
        """`member`'s socket joined the group of `key` (the kernel appends it)."""
        self._members.setdefault(key, []).append(member)

    def leave(self, key: SocketKey, member: int) -> None:
        """As the kernel does: the group's last socket takes the leaver's place."""
        members = self._members.get(key)
        if members is None or member not in members:
            return
        where = members.index(member)
        members[where] = members[-1]
        members.pop()
        if not members:  # the kernel frees the group, and its program with it
            del self._members[key]
            self._programs.pop(key, None)

    def leave_all(self, member: int) -> set[SocketKey]:
        """`member` exited: its sockets left every group; the groups that changed."""
        changed = {key for key, members in self._members.items() if member in members}
        for key in changed:
            self.leave(key, member)
        return changed

    def route_for_joining(self, key: SocketKey, member: int) -> tuple[int, ...] | None:
        """The route `member`'s socket must attach when it joins the group of `key` (None:
        it is there already, or it starts the group and needs no program yet)."""
        members = self._members.get(key, [])
        if member in members:
            return None
        if not members:  # the first socket of a new group: no program yet
            self._programs.pop(key, None)
            return None
        route = self._programs[key] = steering.route_for([*members, member], self._workers)
        return route

    def routes_to_change(self, keys: set[SocketKey]) -> Routes:
        """The routes of the groups in `keys` whose program must change (taken as sent)."""
        routes = {}
        for key in keys:
            members = self._members.get(key)
            if members is None:
                continue
            route = steering.route_for(members, self._workers)
            if len(members) == 1 and members[0] >= 0 and key not in self._programs:
                continue  # one worker's socket alone, without a program: it gets everything
            if self._programs.get(key) != route:
                routes[key] = self._programs[key] = route
        return routes

    def members(self, key: SocketKey) -> tuple[int, ...]:
        """The group of `key`: worker numbers in the kernel's order."""
        return tuple(self._members.get(key, ()))

    def snapshot(self) -> dict[SocketKey, list[int]]:
        """Every group: worker numbers in the kernel's order (a copy)."""
        return {key: list(members) for key, members in self._members.items()}

    def adopt(self, groups: dict[SocketKey, list[int]]) -> None:
        """Take the groups of sockets handed over, in the order their last owner tracked."""
        self._members = {key: list(members) for key, members in groups.items()}
