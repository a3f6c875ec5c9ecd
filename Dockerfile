# Build stage: the release binary, profile-guided (scripts/build: ~10 %
# less CPU per request). redis-server only trains the Redis store's paths.
FROM rust:1-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY integration ./integration
COPY bench ./bench
COPY scripts ./scripts
RUN scripts/build

# Run stage: the binary and the example limits, nothing else.
FROM debian:bookworm-slim
RUN useradd --system --no-create-home tollgate
COPY --from=build /src/target/release/tollgate /usr/local/bin/tollgate
COPY conf /etc/tollgate
# envoyproxy/ratelimit's manifests run /bin/ratelimit: the same binary.
RUN ln -s /usr/local/bin/tollgate /bin/ratelimit
USER tollgate
EXPOSE 8080 8081 9901
CMD ["tollgate", "--config", "/etc/tollgate/limits.yaml"]
