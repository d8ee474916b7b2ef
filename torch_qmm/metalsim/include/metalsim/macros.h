// Macros of the Metal environment that user code may test with #if; shared by the
// staging preprocessor pass and the real compile.
#pragma once
#ifndef __METAL_VERSION__
#ifndef __METAL_VERSION__
#define __METAL_VERSION__ 310
#endif
#endif
#define __METAL__ 1
#define __METALSIM__ 1
#ifndef __HAVE_BFLOAT__
#define __HAVE_BFLOAT__ 1
#endif
#ifndef __HAVE_SIMDGROUP_MATRIX__
#define __HAVE_SIMDGROUP_MATRIX__ 1
#endif
#ifndef M_PI_F
#define M_PI_F 3.14159265358979323846f
#endif
#ifndef M_PI_2_F
#define M_PI_2_F 1.57079632679489661923f
#endif
#ifndef M_PI_4_F
#define M_PI_4_F 0.78539816339744830962f
#endif
#ifndef M_1_PI_F
#define M_1_PI_F 0.31830988618379067154f
#endif
#ifndef M_2_PI_F
#define M_2_PI_F 0.63661977236758134308f
#endif
#ifndef M_2_SQRTPI_F
#define M_2_SQRTPI_F 1.12837916709551257390f
#endif
#ifndef M_SQRT2_F
#define M_SQRT2_F 1.41421356237309504880f
#endif
#ifndef M_SQRT1_2_F
#define M_SQRT1_2_F 0.70710678118654752440f
#endif
#ifndef M_E_F
#define M_E_F 2.71828182845904523536f
#endif
#ifndef M_LOG2E_F
#define M_LOG2E_F 1.44269504088896340736f
#endif
#ifndef M_LOG10E_F
#define M_LOG10E_F 0.43429448190325182765f
#endif
#ifndef M_LN2_F
#define M_LN2_F 0.69314718055994530942f
#endif
#ifndef M_LN10_F
#define M_LN10_F 2.30258509299404568402f
#endif
#ifndef MAXFLOAT
#define MAXFLOAT 3.40282346638528859812e+38f
#endif
#ifndef HUGE_VALF
#define HUGE_VALF __builtin_huge_valf()
#endif
#ifndef INFINITY
#define INFINITY __builtin_inff()
#endif
#ifndef NAN
#define NAN __builtin_nanf("")
#endif
#ifndef FLT_MAX
#define FLT_MAX 3.40282346638528859812e+38f
#endif
#ifndef FLT_MIN
#define FLT_MIN 1.17549435082228750797e-38f
#endif
#ifndef FLT_EPSILON
#define FLT_EPSILON 1.1920928955078125e-7f
#endif
#ifndef HALF_MAX
#define HALF_MAX ((half)65504.0f)
#endif
#ifndef HALF_MIN
#define HALF_MIN ((half)6.103515625e-05f)
#endif
#ifndef HALF_EPSILON
#define HALF_EPSILON ((half)0.0009765625f)
#endif
#ifndef MAXHALF
#define MAXHALF HALF_MAX
#endif
#ifndef INT_MAX
#define INT_MAX 2147483647
#endif
#ifndef INT_MIN
#define INT_MIN (-2147483647 - 1)
#endif
#ifndef UINT_MAX
#define UINT_MAX 4294967295u
#endif
#ifndef SHRT_MAX
#define SHRT_MAX 32767
#endif
#ifndef USHRT_MAX
#define USHRT_MAX 65535
#endif
#ifndef CHAR_BIT
#define CHAR_BIT 8
#endif
