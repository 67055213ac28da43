# The k3s-pinning command in a minimal image, built reproducibly from go.mod/go.sum.
# Not built on the project's own machines (they have no Docker engine); `make build` is the
# tested path.
FROM golang:1.25 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /out/k3s-pinning ./cmd/k3s-pinning

FROM scratch
COPY --from=build /out/k3s-pinning /k3s-pinning
ENTRYPOINT ["/k3s-pinning"]
