// liblingvo_glibc_compat.so, built by glibc_compat/patcher.py with the host's
// C++ compiler: g++ -shared -fPIC -O2 -std=c++11 -D<MACRO>... shim.cc
//
// Provides (unversioned) definitions of a few glibc 2.38 / GCC 13 runtime
// symbols for lingvo's prebuilt ops on hosts with an older glibc/libstdc++.
// Only the definitions enabled with -D<MACRO> are compiled (the macro of each
// symbol is in patcher.SHIM_SYMBOLS). All forwarding targets are bound with
// asm labels so that header redirections (e.g. glibc >= 2.38 mapping strtol
// to __isoc23_strtol) cannot cause recursion.
//
// Caveat: the __isoc23_* functions forward to the pre-C23 implementations,
// so C23-only syntax (binary "0b" prefixes) is not recognised.

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cwchar>
#include <exception>
#include <ios>

#define LC_EXPORT extern "C" __attribute__((visibility("default")))
#define LC_LIST(...) __VA_ARGS__

// __isoc23_<name> (a C23 strto*/wcsto* function) forwarding to <name>.
#define LC_STRTO(type, char_t, name)                              \
  extern "C" type lc_##name(const char_t*, char_t**, int)        \
      __asm__(#name);                                              \
  LC_EXPORT type lc23_##name(const char_t* s, char_t** e, int b) \
      __asm__("__isoc23_" #name);                                  \
  type lc23_##name(const char_t* s, char_t** e, int b) {         \
    return lc_##name(s, e, b);                                     \
  }

// __isoc23_v<name>(params, va_list) forwarding to __isoc99_v<name>; params
// end with the format f, args name them.
#define LC_VSCANF(name, params, args)                     \
  LC_EXPORT int lc23_v##name(LC_LIST params, va_list ap) \
      __asm__("__isoc23_v" #name);                         \
  int lc23_v##name(LC_LIST params, va_list ap) {         \
    return lc_v##name(LC_LIST args, ap);                   \
  }

// __isoc23_<name>(params, ...) passing its arguments to __isoc99_v<name>.
#define LC_SCANF(name, params, args)                 \
  LC_EXPORT int lc23_##name(LC_LIST params, ...)    \
      __asm__("__isoc23_" #name);                    \
  int lc23_##name(LC_LIST params, ...) {            \
    va_list ap;                                      \
    va_start(ap, f);                                 \
    int r = lc_v##name(LC_LIST args, ap);            \
    va_end(ap);                                      \
    return r;                                        \
  }

extern "C" {
int lc_vsscanf(const char*, const char*, va_list) __asm__("__isoc99_vsscanf");
int lc_vfscanf(FILE*, const char*, va_list) __asm__("__isoc99_vfscanf");
int lc_vscanf(const char*, va_list) __asm__("__isoc99_vscanf");
void* lc_cxa_begin_catch(void*) noexcept __asm__("__cxa_begin_catch");
}

#ifdef LC_ISOC23_STRTOL
LC_STRTO(long, char, strtol)
#endif
#ifdef LC_ISOC23_STRTOUL
LC_STRTO(unsigned long, char, strtoul)
#endif
#ifdef LC_ISOC23_STRTOLL
LC_STRTO(long long, char, strtoll)
#endif
#ifdef LC_ISOC23_STRTOULL
LC_STRTO(unsigned long long, char, strtoull)
#endif
#ifdef LC_ISOC23_STRTOIMAX
LC_STRTO(intmax_t, char, strtoimax)
#endif
#ifdef LC_ISOC23_STRTOUMAX
LC_STRTO(uintmax_t, char, strtoumax)
#endif
#ifdef LC_ISOC23_WCSTOL
LC_STRTO(long, wchar_t, wcstol)
#endif
#ifdef LC_ISOC23_WCSTOUL
LC_STRTO(unsigned long, wchar_t, wcstoul)
#endif
#ifdef LC_ISOC23_WCSTOLL
LC_STRTO(long long, wchar_t, wcstoll)
#endif
#ifdef LC_ISOC23_WCSTOULL
LC_STRTO(unsigned long long, wchar_t, wcstoull)
#endif
#ifdef LC_ISOC23_SSCANF
LC_SCANF(sscanf, (const char* s, const char* f), (s, f))
#endif
#ifdef LC_ISOC23_VSSCANF
LC_VSCANF(sscanf, (const char* s, const char* f), (s, f))
#endif
#ifdef LC_ISOC23_FSCANF
LC_SCANF(fscanf, (FILE* s, const char* f), (s, f))
#endif
#ifdef LC_ISOC23_VFSCANF
LC_VSCANF(fscanf, (FILE* s, const char* f), (s, f))
#endif
#ifdef LC_ISOC23_SCANF
LC_SCANF(scanf, (const char* f), (f))
#endif
#ifdef LC_ISOC23_VSCANF
LC_VSCANF(scanf, (const char* f), (f))
#endif

#ifdef LC_IOS_BASE_LIBRARY_INIT
// GCC 13's <iostream> no longer defines a static std::ios_base::Init per
// translation unit; it references this symbol instead so that the library's
// own initializer runs. Older libstdc++ lacks it: initialise the standard
// streams here instead.
namespace {
static std::ios_base::Init lc_ios_init;
}  // namespace
namespace std {
__attribute__((visibility("default"))) void ios_base_library_init() {}
}  // namespace std
#endif

#ifdef LC_CXA_CALL_TERMINATE
// Same behaviour as GCC 13's libsupc++: mark the exception as caught (so the
// terminate handler can inspect it), then terminate.
LC_EXPORT void lc_cxa_call_terminate(void* ue) noexcept
    __asm__("__cxa_call_terminate");
__attribute__((noreturn)) void lc_cxa_call_terminate(void* ue) noexcept {
  if (ue != nullptr) lc_cxa_begin_catch(ue);
  std::terminate();
}
#endif
