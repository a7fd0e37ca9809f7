// Implementation in progress: the public API in kvr/transport/ucx.h is fixed first so that
// kv-store can code against it.
#include "kvr/transport/ucx.h"
