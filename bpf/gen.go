package bpf

// The objects are compiled from the C sources in this directory by bpf2go
// and committed, so that `go get` users never need clang. Regenerate with
// `go generate ./bpf/...` or scripts/build-ebpf.sh after changing any C.
//
// The TC object is built once per map tier: the default (tier M) with the
// Go mirrors of the shared layouts, and tiers S and L with the same code and
// other compile-time capacities (-DFLUXVM_MAP_TIER).
//
// Every C enum the Go side reads is passed with -type, so Go never mirrors
// a C constant by hand: layout.go and counters.go name the generated
// constants (abi_test.go requires a Go name for every enum member).
//
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -go-package bpf -output-stem fluxvm_service -type fluxvm_counter -type fluxvm_drop_reason -type fluxvm_svc4_key -type fluxvm_svc6_key -type fluxvm_svc_value -type fluxvm_fe4_slot -type fluxvm_fe_state -type fluxvm_guard -type fluxvm_backend -type fluxvm_tuple4 -type fluxvm_tuple6 -type fluxvm_ct_value -type fluxvm_nat_value -type fluxvm_svc_stats_value -type fluxvm_meta_value -type fluxvm_edge_slot -type fluxvm_snat_cfg -type fluxvm_abi_const -type fluxvm_family -type fluxvm_svc_flags -type fluxvm_guard_state -type fluxvm_backend_state -type fluxvm_ct_state -type fluxvm_ct_flags -type fluxvm_nat_flags -type fluxvm_be2fe_flags -type fluxvm_be2fe_key -type fluxvm_be2fe_slot -type fluxvm_be2fe_value -type fluxvm_snat_flags -type fluxvm_snat_peer_flags -type fluxvm_timeout_default -type fluxvm_built_tier -type fluxvm_sock_key -type fluxvm_sock_value -type fluxvm_sock_rkey -type fluxvm_sock_rvalue -type fluxvm_edt_value -type fluxvm_flow -type fluxvm_flow_verdict -type fluxvm_flow_hook -type fluxvm_sid4_key -type fluxvm_sid6_key -type fluxvm_sid_value -type fluxvm_spol_key -type fluxvm_spol_value -type fluxvm_spol_const -type fluxvm_policy_action -type fluxvm_policy_flags -type fluxvm_meta_flags -type fluxvm_ha_op -type fluxvm_ha_cause -type fluxvm_ha_record service fluxvm_service.bpf.c -- -O2 -mcpu=v3 -Wall -Werror -I/usr/include/x86_64-linux-gnu -I/usr/include/aarch64-linux-gnu
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -go-package bpf -no-global-types -output-stem fluxvm_service_tier_s serviceTierS fluxvm_service.bpf.c -- -DFLUXVM_MAP_TIER=1 -O2 -mcpu=v3 -Wall -Werror -I/usr/include/x86_64-linux-gnu -I/usr/include/aarch64-linux-gnu
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -go-package bpf -no-global-types -output-stem fluxvm_service_tier_l serviceTierL fluxvm_service.bpf.c -- -DFLUXVM_MAP_TIER=3 -O2 -mcpu=v3 -Wall -Werror -I/usr/include/x86_64-linux-gnu -I/usr/include/aarch64-linux-gnu
//
// The north-south XDP object (fluxvm_service_xdp.bpf.c) and the socket
// load-balancing object (fluxvm_service_connect.bpf.c) are built per tier
// the same way; they declare the same maps, which the loader shares with
// the TC object's. The socket iterator (fluxvm_sock_destroy.bpf.c) is
// built once: the loader gives it the datapath's maps, of any tier; so is
// the map iterator (fluxvm_map_count.bpf.c), which uses none.
//
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -go-package bpf -no-global-types -output-stem fluxvm_service_xdp serviceXdp fluxvm_service_xdp.bpf.c -- -O2 -mcpu=v3 -Wall -Werror -I/usr/include/x86_64-linux-gnu -I/usr/include/aarch64-linux-gnu
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -go-package bpf -no-global-types -output-stem fluxvm_service_xdp_tier_s serviceXdpTierS fluxvm_service_xdp.bpf.c -- -DFLUXVM_MAP_TIER=1 -O2 -mcpu=v3 -Wall -Werror -I/usr/include/x86_64-linux-gnu -I/usr/include/aarch64-linux-gnu
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -go-package bpf -no-global-types -output-stem fluxvm_service_xdp_tier_l serviceXdpTierL fluxvm_service_xdp.bpf.c -- -DFLUXVM_MAP_TIER=3 -O2 -mcpu=v3 -Wall -Werror -I/usr/include/x86_64-linux-gnu -I/usr/include/aarch64-linux-gnu
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -go-package bpf -no-global-types -output-stem fluxvm_service_connect serviceConnect fluxvm_service_connect.bpf.c -- -O2 -mcpu=v3 -Wall -Werror -I/usr/include/x86_64-linux-gnu -I/usr/include/aarch64-linux-gnu
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -go-package bpf -no-global-types -output-stem fluxvm_service_connect_tier_s serviceConnectTierS fluxvm_service_connect.bpf.c -- -DFLUXVM_MAP_TIER=1 -O2 -mcpu=v3 -Wall -Werror -I/usr/include/x86_64-linux-gnu -I/usr/include/aarch64-linux-gnu
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -go-package bpf -no-global-types -output-stem fluxvm_service_connect_tier_l serviceConnectTierL fluxvm_service_connect.bpf.c -- -DFLUXVM_MAP_TIER=3 -O2 -mcpu=v3 -Wall -Werror -I/usr/include/x86_64-linux-gnu -I/usr/include/aarch64-linux-gnu
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -go-package bpf -no-global-types -output-stem fluxvm_sock_destroy sockDestroy fluxvm_sock_destroy.bpf.c -- -O2 -mcpu=v3 -Wall -Werror -I/usr/include/x86_64-linux-gnu -I/usr/include/aarch64-linux-gnu
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -go-package bpf -no-global-types -output-stem fluxvm_map_count mapCount fluxvm_map_count.bpf.c -- -O2 -mcpu=v3 -Wall -Werror -I/usr/include/x86_64-linux-gnu -I/usr/include/aarch64-linux-gnu
