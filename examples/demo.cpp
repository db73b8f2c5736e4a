#include <kvfuse/kvfuse.hpp>
#include <cstdio>
int main() { std::puts("kvfuse demo: placeholder until the index lands"); }
