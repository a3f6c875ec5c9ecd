# Build stage: the release binary.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY integration ./integration
COPY bench ./bench
RUN cargo build --release --locked

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
