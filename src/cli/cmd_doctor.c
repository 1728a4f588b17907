/* cli/cmd_doctor.c — `kvbridge doctor`: checks that a decode node configured like this one
 * (model, cache format, bridge mode, key) would be accepted by a prefill node, and prints the
 * compatibility facts side by side; a refusal names what differs (the handshake's own message). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvb_cli.h"
#include "kvb_model.h"
#include "kvb_quant.h"
#include "kvb_transport.h"

static void help(FILE *f) {
    fprintf(f,
            "usage: kvbridge doctor --peer HOST:PORT -m MODEL [--cache-type T] [--block-tokens N]\n"
            "                       [--bridge-mode decoder|prefill] [--psk KEY]\n\n"
            "Connects to a prefill node as a decode node with these settings would, runs the full handshake\n"
            "(protocol version, mutual key proof, model and cache-format fingerprints, bridge mode) and prints\n"
            "both sides' facts, or the reason the prefill node refused. Exits 0 when they are compatible.\n");
}

static void print_hello(const char *who, const kvb_hello *h) {
    char fmt[96];
    kvb_kvformat_describe(&h->format, fmt, sizeof fmt);
    printf("  %-8s %-10s model %016llx  format %s (%016llx)  mode %s  protocol %u  name '%s'\n", who,
           kvb_wire_role_name(h->role), (unsigned long long)h->model_fingerprint, fmt,
           (unsigned long long)h->format_fingerprint, kvb_bridge_mode_name(h->bridge_mode), h->protocol_version,
           h->name);
}

int kvb_cmd_doctor(int argc, char **argv) {
    const char *cmd = "doctor", *peer = NULL, *model = NULL, *psk = getenv("KVB_PSK"), *mode = "decoder";
    long long bt = 32;
    uint32_t cache_type = KVB_TYPE_F16;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        if (kvb_arg_is_help(a)) {
            help(stdout);
            return 0;
        } else if (!strcmp(a, "--peer")) {
            if (!(peer = kvb_arg_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            if (!(model = kvb_arg_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--psk")) {
            if (!(psk = kvb_arg_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--bridge-mode")) {
            if (!(mode = kvb_arg_value(cmd, argc, argv, &i))) return 2;
        } else if (!strcmp(a, "--block-tokens")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_int(cmd, a, v, 1, 4096, &bt)) return 2;
        } else if (!strcmp(a, "--cache-type")) {
            if (!(v = kvb_arg_value(cmd, argc, argv, &i)) || !kvb_arg_type(cmd, a, v, &cache_type)) return 2;
        } else {
            fprintf(stderr, "kvbridge doctor: unknown option '%s' (see kvbridge doctor --help)\n", a);
            return 2;
        }
    }
    if (!peer || !model || !psk || (strcmp(mode, "decoder") && strcmp(mode, "prefill"))) {
        fprintf(stderr, "kvbridge doctor: give --peer, -m, a key (--psk or KVB_PSK) and --bridge-mode decoder|prefill\n");
        return 2;
    }
    kvb_err err = {0};
    kvb_model *m = NULL;
    kvb_kvformat fmt;
    kvb_hello me, theirs;
    kvb_conn *c = NULL;
    if (kvb_model_load(model, &m, &err) ||
        kvb_model_kvformat(&m->d, cache_type, (uint32_t)bt, &fmt, &err) ||
        kvb_hello_init(&me, KVB_ROLE_DECODE, !strcmp(mode, "prefill") ? KVB_BRIDGE_MODE_PREFILL : KVB_BRIDGE_MODE_DECODER,
                       "doctor", m->fingerprint, &fmt, &err)) {
        fprintf(stderr, "kvbridge doctor: %s\n", err.msg);
        kvb_model_free(m);
        return 1;
    }
    printf("kvbridge doctor: %s as a decode node would see it\n", peer);
    print_hello("this", &me);
    kvb_transport_config cfg = {.psk = (const uint8_t *)psk, .psk_len = strlen(psk)};
    int rc = 0;
    if (kvb_transport_connect(peer, &me, &cfg, 5000, &c, &theirs, &err)) {
        printf("  refused: %s\n", err.msg);
        rc = 1;
    } else {
        print_hello("peer", &theirs);
        printf("  compatible: the key proofs verified and every fingerprint matches; bridging will be used\n");
        kvb_conn_close(c);
    }
    kvb_model_free(m);
    return rc;
}
