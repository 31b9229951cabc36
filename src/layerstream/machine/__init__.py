"""Planning for a machine given by its figures (`layerstream plan --device-memory --host-memory`): the config it
should run (`planner`), the one whose every phase fits (`device_fit`), each phase's peak from its parts
(`phases`). It sits above `enable_offload`; what enabling reads of the host itself is in `layerstream.host`."""
