/* cli/cmd_doctor.c — `kvbridge doctor`: checks that a decode node configured like this one
 * (model, cache format, bridge mode, key, transport) would be accepted by a prefill node, and
 * prints the compatibility facts side by side and what carries the connection (over UCX: the
 * transports UCX selected, so a fallback to TCP shows); a refusal names what differs (the
 * handshake's own message). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_model.h"
#include "kvb_quant.h"
#include "kvb_transport.h"

static void print_hello(const char *who, const kvb_hello *h) {
    char fmt[96];
    kvb_kvformat_describe(&h->format, fmt, sizeof fmt);
    printf("  %-8s %-10s model %016llx  format %s (%016llx)  mode %s  protocol %u  name '%s'\n", who,
           kvb_wire_role_name(h->role), (unsigned long long)h->model_fingerprint, fmt,
           (unsigned long long)h->format_fingerprint, kvb_bridge_mode_name(h->bridge_mode), h->protocol_version,
           h->name);
}

int kvb_cmd_doctor(int argc, char **argv) {
    const char *peer = NULL, *model = NULL, *psk = getenv("KVB_PSK");
    long long bt = 0;
    int mode = 0;      /* kvb_cli_bridge_mode_names */
    int transport = 0; /* kvb_cli_transport_names */
    uint32_t cache_type = KVB_TYPE_F16;
    const kvb_opt opts[] = {
        {.long_name = "peer", .kind = KVB_OPT_STRING, .dst = &peer, .meta = "HOST:PORT", .required = true,
         .help = "the prefill node"},
        KVB_CLI_OPT_MODEL(&model, "the decoder's GGUF", true),
        KVB_CLI_OPT_CACHE_TYPE(&cache_type, "the decoder's cache dtype"),
        KVB_CLI_OPT_BLOCK_TOKENS(&bt, "tokens per cache block"),
        KVB_CLI_OPT_BRIDGE_MODE(&mode),
        KVB_CLI_OPT_PSK(&psk, "pre-shared key (or env KVB_PSK)"),
        KVB_CLI_OPT_TRANSPORT(&transport, "how the decode node reaches the prefill node (as its --transport)"),
        {0},
    };
    const kvb_cli_spec spec = {
        .name = "doctor", .opts = opts,
        .usage = "--peer HOST:PORT -m MODEL [--cache-type T] [--block-tokens N] [--bridge-mode decoder|prefill] "
                 "[--psk KEY] [--transport tcp|ucx]",
        .about = "Connects to a prefill node as a decode node with these settings would, runs the full handshake "
                 "(protocol version, mutual key proof, model and cache-format fingerprints, bridge mode) and prints "
                 "both sides' facts, or the reason the prefill node refused. Exits 0 when they are compatible."};
    int prc = kvb_cli_parse(&spec, argc, argv);
    if (prc != KVB_CLI_GO) return prc;
    if (!psk) return kvb_cli_usage_error(&spec, "give a key: --psk KEY or the environment's KVB_PSK");
    kvb_err err = {0};
    kvb_model *m = NULL;
    kvb_kvformat fmt;
    kvb_hello me, theirs;
    kvb_conn *c = NULL;
    if (kvb_model_load(model, &m, &err) ||
        kvb_model_kvformat(&m->d, cache_type, (uint32_t)bt, &fmt, &err) ||
        kvb_hello_init(&me, KVB_ROLE_DECODE, mode == 1 ? KVB_BRIDGE_MODE_PREFILL : KVB_BRIDGE_MODE_DECODER,
                       "doctor", m->fingerprint, &fmt, &err)) {
        fprintf(stderr, "kvbridge doctor: %s\n", err.msg);
        kvb_model_free(m);
        return 1;
    }
    printf("kvbridge doctor: %s as a decode node would see it\n", peer);
    print_hello("this", &me);
    kvb_transport_config cfg = {.psk = (const uint8_t *)psk, .psk_len = strlen(psk)};
    int rc = 0;
    if (kvb_wire_backend_by_name(kvb_cli_transport_names[transport], &cfg.backend, &err)) {
        fprintf(stderr, "kvbridge doctor: %s\n", err.msg);
        kvb_model_free(m);
        return 2;
    }
    if (kvb_transport_connect(peer, &me, &cfg, 5000, &c, &theirs, &err)) {
        printf("  refused: %s\n", err.msg);
        rc = 1;
    } else {
        print_hello("peer", &theirs);
        char how[320];
        kvb_conn_describe(c, how, sizeof how);
        printf("  carried by %s\n", how);
        printf("  compatible: the key proofs verified and every fingerprint matches; bridging will be used\n");
        kvb_conn_close(c);
    }
    kvb_model_free(m);
    return rc;
}
