/* cli/cmd_demo.c — placeholder until its module lands. */
#include <stdio.h>

#include "kvb_cli.h"

int kvb_cmd_demo(int argc, char **argv) {
    (void)argc;
    fprintf(stderr, "kvbridge %s: not built yet\n", argv[0]);
    return 2;
}
