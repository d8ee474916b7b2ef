// The GGUF K-quant block structs live in metal/gguf_format.h, the header shared by host C++ and
// the Metal kernels (one fact, one place); this forwarding header keeps host includes short.
#pragma once

#include "../metal/gguf_format.h"
