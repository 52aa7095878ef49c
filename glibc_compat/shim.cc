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

extern "C" {
long lc_strtol(const char*, char**, int) __asm__("strtol");
unsigned long lc_strtoul(const char*, char**, int) __asm__("strtoul");
long long lc_strtoll(const char*, char**, int) __asm__("strtoll");
unsigned long long lc_strtoull(const char*, char**, int)
    __asm__("strtoull");
intmax_t lc_strtoimax(const char*, char**, int) __asm__("strtoimax");
uintmax_t lc_strtoumax(const char*, char**, int) __asm__("strtoumax");
long lc_wcstol(const wchar_t*, wchar_t**, int) __asm__("wcstol");
unsigned long lc_wcstoul(const wchar_t*, wchar_t**, int) __asm__("wcstoul");
long long lc_wcstoll(const wchar_t*, wchar_t**, int) __asm__("wcstoll");
unsigned long long lc_wcstoull(const wchar_t*, wchar_t**, int)
    __asm__("wcstoull");
int lc_vsscanf(const char*, const char*, va_list) __asm__("__isoc99_vsscanf");
int lc_vfscanf(FILE*, const char*, va_list) __asm__("__isoc99_vfscanf");
int lc_vscanf(const char*, va_list) __asm__("__isoc99_vscanf");
void* lc_cxa_begin_catch(void*) noexcept __asm__("__cxa_begin_catch");
}

#ifdef LC_ISOC23_STRTOL
LC_EXPORT long lc23_strtol(const char* s, char** e, int b)
    __asm__("__isoc23_strtol");
long lc23_strtol(const char* s, char** e, int b) { return lc_strtol(s, e, b); }
#endif
#ifdef LC_ISOC23_STRTOUL
LC_EXPORT unsigned long lc23_strtoul(const char* s, char** e, int b)
    __asm__("__isoc23_strtoul");
unsigned long lc23_strtoul(const char* s, char** e, int b) {
  return lc_strtoul(s, e, b);
}
#endif
#ifdef LC_ISOC23_STRTOLL
LC_EXPORT long long lc23_strtoll(const char* s, char** e, int b)
    __asm__("__isoc23_strtoll");
long long lc23_strtoll(const char* s, char** e, int b) {
  return lc_strtoll(s, e, b);
}
#endif
#ifdef LC_ISOC23_STRTOULL
LC_EXPORT unsigned long long lc23_strtoull(const char* s, char** e, int b)
    __asm__("__isoc23_strtoull");
unsigned long long lc23_strtoull(const char* s, char** e, int b) {
  return lc_strtoull(s, e, b);
}
#endif
#ifdef LC_ISOC23_STRTOIMAX
LC_EXPORT intmax_t lc23_strtoimax(const char* s, char** e, int b)
    __asm__("__isoc23_strtoimax");
intmax_t lc23_strtoimax(const char* s, char** e, int b) {
  return lc_strtoimax(s, e, b);
}
#endif
#ifdef LC_ISOC23_STRTOUMAX
LC_EXPORT uintmax_t lc23_strtoumax(const char* s, char** e, int b)
    __asm__("__isoc23_strtoumax");
uintmax_t lc23_strtoumax(const char* s, char** e, int b) {
  return lc_strtoumax(s, e, b);
}
#endif
#ifdef LC_ISOC23_WCSTOL
LC_EXPORT long lc23_wcstol(const wchar_t* s, wchar_t** e, int b)
    __asm__("__isoc23_wcstol");
long lc23_wcstol(const wchar_t* s, wchar_t** e, int b) {
  return lc_wcstol(s, e, b);
}
#endif
#ifdef LC_ISOC23_WCSTOUL
LC_EXPORT unsigned long lc23_wcstoul(const wchar_t* s, wchar_t** e, int b)
    __asm__("__isoc23_wcstoul");
unsigned long lc23_wcstoul(const wchar_t* s, wchar_t** e, int b) {
  return lc_wcstoul(s, e, b);
}
#endif
#ifdef LC_ISOC23_WCSTOLL
LC_EXPORT long long lc23_wcstoll(const wchar_t* s, wchar_t** e, int b)
    __asm__("__isoc23_wcstoll");
long long lc23_wcstoll(const wchar_t* s, wchar_t** e, int b) {
  return lc_wcstoll(s, e, b);
}
#endif
#ifdef LC_ISOC23_WCSTOULL
LC_EXPORT unsigned long long lc23_wcstoull(const wchar_t* s, wchar_t** e,
                                           int b) __asm__("__isoc23_wcstoull");
unsigned long long lc23_wcstoull(const wchar_t* s, wchar_t** e, int b) {
  return lc_wcstoull(s, e, b);
}
#endif
#ifdef LC_ISOC23_SSCANF
LC_EXPORT int lc23_sscanf(const char* s, const char* f, ...)
    __asm__("__isoc23_sscanf");
int lc23_sscanf(const char* s, const char* f, ...) {
  va_list ap;
  va_start(ap, f);
  int r = lc_vsscanf(s, f, ap);
  va_end(ap);
  return r;
}
#endif
#ifdef LC_ISOC23_VSSCANF
LC_EXPORT int lc23_vsscanf(const char* s, const char* f, va_list ap)
    __asm__("__isoc23_vsscanf");
int lc23_vsscanf(const char* s, const char* f, va_list ap) {
  return lc_vsscanf(s, f, ap);
}
#endif
#ifdef LC_ISOC23_FSCANF
LC_EXPORT int lc23_fscanf(FILE* s, const char* f, ...)
    __asm__("__isoc23_fscanf");
int lc23_fscanf(FILE* s, const char* f, ...) {
  va_list ap;
  va_start(ap, f);
  int r = lc_vfscanf(s, f, ap);
  va_end(ap);
  return r;
}
#endif
#ifdef LC_ISOC23_VFSCANF
LC_EXPORT int lc23_vfscanf(FILE* s, const char* f, va_list ap)
    __asm__("__isoc23_vfscanf");
int lc23_vfscanf(FILE* s, const char* f, va_list ap) {
  return lc_vfscanf(s, f, ap);
}
#endif
#ifdef LC_ISOC23_SCANF
LC_EXPORT int lc23_scanf(const char* f, ...) __asm__("__isoc23_scanf");
int lc23_scanf(const char* f, ...) {
  va_list ap;
  va_start(ap, f);
  int r = lc_vscanf(f, ap);
  va_end(ap);
  return r;
}
#endif
#ifdef LC_ISOC23_VSCANF
LC_EXPORT int lc23_vscanf(const char* f, va_list ap) __asm__("__isoc23_vscanf");
int lc23_vscanf(const char* f, va_list ap) { return lc_vscanf(f, ap); }
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
