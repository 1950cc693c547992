// Imported first by the CLI: the bench reports errors itself, one line each, so gRPC's own
// stderr logging (read from the environment when @grpc/grpc-js loads) is off unless asked for.
process.env['GRPC_VERBOSITY'] ??= 'NONE';
