/* tests/support/fake_peer.h — misbehaving prefill nodes for the tests of a decode node's link: a
 * loopback listener whose thread accepts every connection (a link dials again and again) and then
 * stays silent, trickles the start of a valid frame header a byte at a time, speaks garbage at
 * once, or refuses the handshake with an ERROR frame (busy). Plain sockets, no kvbridge code on
 * the peer's side, so nothing of the transport under test helps the peer along. */
#ifndef KVBT_FAKE_PEER_H
#define KVBT_FAKE_PEER_H

#include <stdint.h>

typedef enum {
    KVBT_PEER_SILENT = 0, /* accepts, reads nothing, says nothing */
    KVBT_PEER_TRICKLE,    /* accepts, sends one byte of a frame header every 50 ms */
    KVBT_PEER_GARBAGE,    /* accepts, sends 256 bytes that are no frame at once */
    KVBT_PEER_BUSY,       /* accepts, answers with an ERROR frame ([request] "busy"), closes */
} kvbt_peer_kind;

typedef struct kvbt_fake_peer kvbt_fake_peer;

/* Listens on 127.0.0.1, an ephemeral port; fails the test when it cannot. */
kvbt_fake_peer *kvbt_fake_peer_start(kvbt_peer_kind kind);
uint16_t kvbt_fake_peer_port(const kvbt_fake_peer *p);
/* Connections accepted so far. */
unsigned kvbt_fake_peer_accepted(kvbt_fake_peer *p);
/* Stops the thread and closes every socket. NULL is fine. */
void kvbt_fake_peer_stop(kvbt_fake_peer *p);

#endif
